"""`dflashctl push`: send the trainer payload to `<workdir>/payload` incrementally and atomically.

A push is one remote command, `payload_sync sync`, driven both ways: it prints the live
payload's verified manifest; the client diffs it against the local tree and, if anything
differs, streams back a header plus the bytes of new and changed files; the remote builds a
complete new version next to the live one (unchanged files hard-linked), verifies every hash
and swaps a symlink with rename(2). Design and failure modes: docs/push.md.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn, Protocol

from rich.filesize import decimal

import dflashctl

from .containers import Dialogue, Target, remote_script
from .errors import ConflictError, ConnectError, ContainerError, RemoteError, UsageError
from .remote import payload_sync as wire

if TYPE_CHECKING:
    import pathspec
    from rich.console import Console
    from rich.progress import TaskID

SCRIPT = "payload_sync"
IGNORE_FILE = ".dflashignore"
DEFAULT_IGNORES = ("__pycache__/", "*.pyc", ".git/", "build/", "dist/", "*.egg-info/")  # names, no inner "/"
READ_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One payload file as both sides describe it: relative POSIX path, size, sha256, mode bits."""

    path: str
    size: int
    sha256: str
    mode: int

    def wire(self) -> dict:
        """The compact dict form used by the remote script and the manifest hash."""
        return {"p": self.path, "s": self.size, "h": self.sha256, "m": self.mode}


@dataclass
class PushPlan:
    """What a push must do: files to send, files carried over unchanged, paths to delete."""

    send: list[FileEntry]
    keep: list[FileEntry]
    delete: list[str]

    @property
    def empty(self) -> bool:
        """True when the remote payload already equals the local one."""
        return not self.send and not self.delete


@dataclass
class PushResult:
    """The outcome of one push (or dry run)."""

    files_sent: int
    bytes_sent: int
    deleted: int
    unchanged: int
    elapsed_s: float
    remote_dir: str
    manifest_hash: str
    remote_commands: int
    dry_run: bool = False
    sent_paths: list[str] = field(default_factory=list)
    deleted_paths: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """`pushed 3 files (12.4 kB), deleted 1, unchanged 41 in 0.4 s`, or of a dry run
        `would push 3 files (12.4 kB), would delete 1, unchanged 41`."""
        sent = f"{self.files_sent} {'file' if self.files_sent == 1 else 'files'} ({decimal(self.bytes_sent)})"
        if self.dry_run:  # no time: it would read as the push's
            return f"would push {sent}, would delete {self.deleted}, unchanged {self.unchanged}"
        return f"pushed {sent}, deleted {self.deleted}, unchanged {self.unchanged} in {self.elapsed_s:.1f} s"


class ProgressSink(Protocol):
    """Receives transfer progress; `dflashctl push` renders it as a rich progress bar."""

    def start(self, files: int, total_bytes: int) -> None:
        """Called once before any content is sent."""

    def advance(self, files: int = 0, nbytes: int = 0) -> None:
        """Called as bytes go out and as each file completes."""


class BarProgress:
    """A rich progress bar over bytes that also counts files; use as a context manager."""

    def __init__(self, console: Console):
        # Imported here: only a push to a terminal draws the bar, and start-up is most of a small push.
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self._progress = Progress(
            TextColumn("pushing"),
            BarColumn(),
            TextColumn("{task.fields[done]}/{task.fields[files]} files"),
            DownloadColumn(binary_units=False),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        )
        self._task: TaskID | None = None
        self._done = 0

    def __enter__(self) -> "BarProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, files: int, total_bytes: int) -> None:
        """Create the bar once the plan is known."""
        self._task = self._progress.add_task("push", total=total_bytes, files=files, done=0)

    def advance(self, files: int = 0, nbytes: int = 0) -> None:
        """Move the bar by nbytes and the file count by files."""
        if self._task is None:
            return
        self._done += files
        self._progress.update(self._task, advance=nbytes, done=self._done)


def default_source() -> Path:
    """The trainer to push: `dflashctl/_payload/` in an installed wheel, else (a checkout, or an
    editable install) the repository's `remote_payload/` beside the package."""
    package = Path(dflashctl.__file__).resolve().parent
    shipped = package / "_payload"
    return shipped if shipped.is_dir() else package.parent / "remote_payload"


class DefaultIgnores:
    """DEFAULT_IGNORES alone, matched as gitignore matches a pattern without an inner slash: on
    any name in the path, a trailing `/` for directories only. Used when the source has no
    `.dflashignore`: importing pathspec costs more CPU than a small push."""

    def match_file(self, rel: str) -> bool:
        """Whether rel (a directory ends in `/`) is ignored."""
        names = rel.rstrip("/").split("/")
        return any(self._match(name, is_dir=i < len(names) - 1 or rel.endswith("/")) for i, name in enumerate(names))

    @staticmethod
    def _match(name: str, is_dir: bool) -> bool:
        return any(fnmatch.fnmatchcase(name, p.rstrip("/")) for p in DEFAULT_IGNORES if is_dir or not p.endswith("/"))


def load_ignores(source: Path) -> "pathspec.GitIgnoreSpec | DefaultIgnores":
    """The defaults plus the source's `.dflashignore` (gitignore syntax)."""
    ignore_file = source / IGNORE_FILE
    if not ignore_file.is_file():
        return DefaultIgnores()
    import pathspec

    lines = [*DEFAULT_IGNORES, *ignore_file.read_text(encoding="utf-8").splitlines()]
    return pathspec.GitIgnoreSpec.from_lines(lines)


def scan_local(source: Path) -> dict[str, FileEntry]:
    """Every non-ignored file under source, hashed, keyed by relative POSIX path."""
    if not source.is_dir():
        raise UsageError(f"payload source is not a directory: {source}")
    spec = load_ignores(source)
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(source):
        rel_dir = Path(dirpath).relative_to(source).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        # Prune ignored directories here so their contents are never even listed.
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(source, prefix + d, spec))
        paths += [prefix + name for name in sorted(filenames) if not spec.match_file(prefix + name)]
    # hashlib releases the GIL on large buffers, so threads hash on every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(paths, pool.map(lambda rel: _entry(source / rel, rel), paths)))


def _skip_dir(source: Path, rel: str, spec: "pathspec.GitIgnoreSpec | DefaultIgnores") -> bool:
    if spec.match_file(rel + "/"):
        return True
    if (source / rel).is_symlink():
        raise UsageError(f"payload contains a symlinked directory, which push does not follow: {rel}")
    return False


def _entry(path: Path, rel: str) -> FileEntry:
    try:
        st = path.stat()  # follows a symlinked file: its content is what the trainer reads
    except FileNotFoundError:
        raise UsageError(f"payload contains a broken symlink: {rel}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"payload contains something that is not a regular file: {rel}")
    sha, size = wire.hash_file(path)
    return FileEntry(rel, size, sha, stat.S_IMODE(st.st_mode))


def manifest_hash(entries: dict[str, FileEntry]) -> str:
    """Stable sha256 of a manifest (recorded in each run's run.json)."""
    return wire.manifest_hash([e.wire() for e in entries.values()])


def plan_push(local: dict[str, FileEntry], remote: dict[str, FileEntry]) -> PushPlan:
    """Diff local against remote: identical entries are kept, the rest sent, missing deleted."""
    send, keep = [], []
    for path in sorted(local):
        (keep if remote.get(path) == local[path] else send).append(local[path])
    delete = sorted(set(remote) - set(local))
    return PushPlan(send=send, keep=keep, delete=delete)


def push(
    target: Target, source: Path | None = None, *, dry_run: bool = False, progress: ProgressSink | None = None
) -> PushResult:
    """Make `<workdir>/payload` on target equal to source; only changed files travel."""
    started = time.monotonic()
    source = Path(source) if source is not None else default_source()
    local = scan_local(source)
    digest = manifest_hash(local)
    with _RemoteSync(target, dry_run=dry_run) as remote:
        listing = remote.reply()
        plan = plan_push(local, _entries(listing["files"]))
        if dry_run or plan.empty:
            remote.finish()  # closing stdin unsent tells the remote there is nothing to do
        else:
            _check_space(target, plan, listing["free"])
            _apply(remote, source, plan, digest, progress)
    return PushResult(
        files_sent=len(plan.send),
        bytes_sent=sum(e.size for e in plan.send),
        deleted=len(plan.delete),
        unchanged=len(plan.keep),
        elapsed_s=time.monotonic() - started,
        remote_dir=listing["remote_dir"],
        manifest_hash=digest,
        remote_commands=1,
        dry_run=dry_run,
        sent_paths=[e.path for e in plan.send],
        deleted_paths=plan.delete,
    )


def _entries(files: list[dict]) -> dict[str, FileEntry]:
    return {f["p"]: FileEntry(f["p"], f["s"], f["h"], f["m"]) for f in files}


def _check_space(target: Target, plan: PushPlan, free: int) -> None:
    need = sum(e.size for e in plan.send)
    if need > free:
        raise RemoteError(
            f"{target.label}: not enough space in {target.host.workdir}: need {decimal(need)}, "
            f"{decimal(free)} free (any previous payload is unchanged)"
        )


def _apply(remote: "_RemoteSync", source: Path, plan: PushPlan, digest: str, progress: ProgressSink | None) -> None:
    """Stream the header and new content to the remote and check the manifest hash it reports."""
    vid = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + os.urandom(4).hex()
    files = [dict(e.wire(), src="stream") for e in plan.send] + [dict(e.wire(), src="base") for e in plan.keep]
    files.sort(key=lambda f: f["p"])
    header = {"format": wire.FORMAT, "vid": vid, "hash": digest, "files": files}
    if progress is not None:
        progress.start(len(plan.send), sum(e.size for e in plan.send))
    label = remote.target.label
    try:
        remote.send(_stream(header, plan.send, source, progress))
        reply = remote.reply()
        remote.finish()
    except ConnectError as exc:
        # The swap is one rename: the remote holds the old or the new version, never a mix.
        raise ConnectError(
            f"{exc} during push; the remote payload is intact (old or new version), run push again"
        ) from None
    if reply.get("hash") != digest or reply.get("vid") != vid:
        raise RemoteError(
            f"{label}: verification failed: remote manifest {str(reply.get('hash'))[:12]} != local {digest[:12]}"
        )


def _stream(header: dict, send: list[FileEntry], source: Path, progress: ProgressSink | None) -> Iterator[bytes]:
    """Header line, then each sent file's bytes in header order; a file that changed size aborts."""
    yield (json.dumps(header) + "\n").encode("ascii")
    for entry in sorted(send, key=lambda e: e.path):
        left = entry.size
        with open(source / entry.path, "rb") as handle:
            while left:
                chunk = handle.read(min(READ_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk
                if progress is not None:
                    progress.advance(nbytes=len(chunk))
        if left:
            raise UsageError(f"{entry.path} changed while it was being pushed; run push again")
        if progress is not None:
            progress.advance(files=1)


class _RemoteSync:
    """One `payload_sync sync` process in the container: a listing out, changes in, a reply out.

    Driving one process both ways keeps every push to a single remote command. The remote
    writes only two short JSON lines to stdout, each read before the next write, so the
    dialogue cannot deadlock; stderr is drained by a thread for the error message.
    """

    def __init__(self, target: Target, *, dry_run: bool):
        self.target = target
        # -S skips site-packages: the script needs only the stdlib, and startup is ~100 ms faster.
        argv = [target.host.interpreter, "-S", "-c", remote_script(SCRIPT), "sync", target.host.workdir]
        if dry_run:
            argv.append("--dry-run")
        self._dialogue = Dialogue(target, argv)

    def __enter__(self) -> "_RemoteSync":
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self._dialogue.__exit__(kind)  # an error: kill, so the remote sees EOF and discards its staging

    def reply(self) -> dict:
        """The next JSON line from the remote; its error, if it ended without one."""
        line = self._dialogue.line()
        if line is None:
            self._fail()
        try:
            return json.loads(line.decode("utf-8"))
        except ValueError:
            raise RemoteError(f"{self.target.label}: payload_sync printed unexpected output: {line[:80]!r}") from None

    def send(self, chunks: Iterator[bytes]) -> None:
        """Write chunks to the remote's stdin, then close it."""
        try:
            for chunk in chunks:
                self._dialogue.proc.stdin.write(chunk)
        except (OSError, EOFError):
            pass  # the remote stopped reading; its exit status and stderr say why
        finally:
            self._close_stdin()

    def finish(self) -> None:
        """Close stdin and wait; a non-zero exit becomes the remote's one-line error."""
        self._close_stdin()
        if self._dialogue.proc.wait() != 0:
            self._fail()

    def _close_stdin(self) -> None:
        try:
            self._dialogue.proc.stdin.close()
        except (OSError, EOFError):
            pass

    def _fail(self) -> NoReturn:
        result = self._dialogue.ended()
        _raise_remote(self.target, result.exit_code, result.err_line())


_MISSING = re.compile(r"no such file|not found", re.I)
_REMOTE_ERRORS = {wire.EXIT_BUSY: ConflictError}


def _raise_remote(target: Target, code: int, line: str) -> NoReturn:
    """Turn a failed remote step into one line; the live payload is untouched by any failure."""
    interpreter = target.host.interpreter
    if interpreter in line and _MISSING.search(line):
        # Target only knows the shell's 127; lxc-attach reports a failed exec its own way.
        raise ContainerError(
            f"{target.label}: interpreter `{interpreter}` not found in the container "
            f"(set `python` for this host in hosts.yaml)"
        )
    message = line.removeprefix("payload_sync: ")
    error = _REMOTE_ERRORS.get(code, RemoteError)
    raise error(f"{target.label}: push failed: {message} (any previous payload is unchanged)")
