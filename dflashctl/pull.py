"""`dflashctl runs pull`: copy a run's directory (export, logs, metrics, chosen checkpoints) here.

The container's `runctl pack` answers with one JSON header line (run id, state, file count and
bytes), then streams the files as a tar. The tar is unpacked into a hidden directory beside
the destination and renamed into place only once every file arrived and the remote exited 0,
so an interrupted pull leaves nothing behind and never a half-copied run under the real name.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, NoReturn

from .agent import AgentMissing, agent_argv, is_missing, with_agent
from .containers import Dialogue, Target
from .errors import ConnectError, DflashError, Interrupted, RemoteError, UsageError
from .guard import may_still_run, start_guarded
from .remote.wire import CHECKPOINT_CHOICES
from .runs import answer_error
from .transport import CHUNK


@dataclass(frozen=True)
class Pulled:
    """What one pull copied: the run, where it went, how much, how long, the run's state then."""

    run_id: str
    dest: Path
    files: int
    bytes: int
    seconds: float
    state: str


def pull_run(
    target: Target,
    selector: str | None,
    dest: Path | None,
    checkpoints: str = "none",
    on_bytes: Callable[[int, int], None] | None = None,
) -> Pulled:
    """Copy a run's files to dest (default ./RUN_ID), atomically; on_bytes(done, total) reports progress."""
    if checkpoints not in CHECKPOINT_CHOICES:
        raise UsageError(f"--checkpoints must be one of {', '.join(CHECKPOINT_CHOICES)}, got {checkpoints!r}")
    if dest is not None:  # known before asking the host: refuse at once
        _refuse_existing(dest)
    started = time.monotonic()
    args = ["pack", target.host.workdir, selector or "", checkpoints]
    pack, header = with_agent(target, lambda: _Pack.open(target, agent_argv(target, "runctl", args, ["-S"])))
    with pack:
        if dest is None:
            dest = Path.cwd() / header["run_id"]
            _refuse_existing(dest)
        _make_parent(dest)
        partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
        try:
            files, size = pack.unpack(partial, header["bytes"], on_bytes)
            pack.finish()
            if (files, size) != (header["files"], header["bytes"]):
                raise RemoteError(
                    f"{target.label}: pull incomplete: {files} of {header['files']} files, "
                    f"{size} of {header['bytes']} bytes"
                )
            partial.rename(dest)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, ConnectError):
                raise ConnectError(f"{exc} during pull; nothing was kept at {dest}, run it again") from None
            if isinstance(exc, OSError):  # this machine's disk: full, read-only, or not ours
                why = exc.strerror or str(exc)
                raise DflashError(
                    f"cannot write the pulled files under {dest.parent}: {why}; nothing was kept at {dest}"
                ) from None
            raise
    return Pulled(header["run_id"], dest, files, size, time.monotonic() - started, header["state"])


def _make_parent(dest: Path) -> None:
    """The directory that will hold dest (UsageError when --to names a place that cannot have one)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise UsageError(f"cannot pull into {dest}: {exc.filename} is not a directory") from None
    except OSError as exc:
        raise UsageError(f"cannot pull into {dest}: {exc.strerror or exc} ({exc.filename})") from None


def _refuse_existing(dest: Path) -> None:
    if dest.exists() or dest.is_symlink():
        raise UsageError(f"{dest} already exists: pull into a new directory (--to)")


class _Pack:
    """One `runctl pack` process: its header line, then its tar stream."""

    def __init__(self, target: Target, argv: list[str]):
        self.target = target
        # Guarded: a pull of checkpoints can stream for minutes, and a pack that the closed channel
        # does not reach (under `docker exec`, or not writing just then) would run on after a Ctrl-C.
        self.dialogue = Dialogue(target, argv, start=start_guarded)

    @classmethod
    def open(cls, target: Target, argv: list[str]) -> tuple["_Pack", dict]:
        """Start `runctl pack` and read its header (the process is stopped if that fails)."""
        pack = cls(target, argv)
        try:
            return pack, pack.header()
        except BaseException as exc:
            pack.__exit__(type(exc))
            raise

    def __enter__(self) -> "_Pack":
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.dialogue.__exit__(kind)  # Ctrl-C or an error: stop the remote tar on the host
        left = may_still_run(self.dialogue.proc)
        if left and kind is not None and issubclass(kind, Interrupted):  # as run_guarded says it
            raise Interrupted(f"{self.target.label}: the command may still run ({left})") from None

    def header(self) -> dict:
        """The JSON line before the tar; an error answer or an early exit raises."""
        line = self.dialogue.line()
        if line is None:
            self._fail()
        try:
            answer = json.loads(line)
        except ValueError:
            raise RemoteError(f"{self.target.label}: runctl pack printed unexpected output: {line[:80]!r}") from None
        if "error" in answer:
            raise answer_error(self.target, answer)
        return answer

    def unpack(self, into: Path, total: int, on_bytes: Callable[[int, int], None] | None) -> tuple[int, int]:
        """Extract the tar into `into` (regular files under it only); returns (files, bytes)."""
        into.mkdir()
        files = done = 0
        try:
            with tarfile.open(fileobj=self.dialogue, mode="r|") as tar:  # type: ignore[call-overload]
                for member in tar:
                    name = PurePosixPath(member.name)
                    if not member.isfile() or name.is_absolute() or ".." in name.parts or not name.parts:
                        raise RemoteError(f"{self.target.label}: refusing tar member {member.name!r}")
                    path = into.joinpath(*name.parts)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    assert source is not None  # a regular file always has data
                    with open(path, "wb") as out:
                        while chunk := source.read(CHUNK):
                            out.write(chunk)
                            done += len(chunk)
                            if on_bytes is not None:
                                on_bytes(done, total)
                    os.chmod(path, member.mode & 0o755 | 0o600)
                    os.utime(path, (member.mtime, member.mtime))
                    files += 1
        except tarfile.TarError:
            self._fail()  # the stream broke off: the remote's exit status or the lost connection says why
        return files, done

    def finish(self) -> None:
        """Wait for the remote; a non-zero exit is its one-line error."""
        if self.dialogue.proc.wait() != 0:
            self._fail()

    def _fail(self) -> NoReturn:
        result = self.dialogue.ended()
        if is_missing(result.exit_code, result.stderr):
            raise AgentMissing()
        raise RemoteError(f"{self.target.label}: runs pull failed (exit {result.exit_code}): {result.err_line()}")
