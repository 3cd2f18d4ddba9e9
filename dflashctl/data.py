"""`dflashctl data push/list`: datasets in `<workdir>/data/` in the container (the remote half is
`remote/data_sync.py`). A file is hashed here while it is read in chunks (never held in memory),
skipped when the container already has the same bytes, else streamed into a hidden partial file
there and renamed over the old copy only once its size and sha256 check out. Every row of a file
to be sent is checked first (row_kinds), so a malformed or empty file is refused before any file is sent.
docs/data.md."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .containers import Target
from .errors import RemoteError, UsageError

CHUNK = 1 << 20
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
TOKEN_IDS = "token ids (integers >= 0)"
TRAIN_KINDS = frozenset({"input_ids", "messages"})  # the rows the trainer reads; `prompt` rows are regen's
# `data regen`'s failed rows ({"index", "reason"}) beside its output X.jsonl: X.errors.jsonl
# (remote_payload's regen_output.errors_path). Never a dataset: no push, regen or training run takes the name.
ERRORS_SUFFIX = ".errors.jsonl"


class BadRow(ValueError):
    """A JSONL line that is no dataset row; the message says why."""


@dataclass(frozen=True)
class Pushed:
    """One dataset after a push: its name, size, rows, hash, whether bytes travelled, and its row kinds."""

    name: str
    size: int
    rows: int
    sha256: str
    sent: bool
    kinds: frozenset[str]  # of every row when it was sent; of its first MB when the host had it unchanged


def digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def row_kinds(path: Path, whole: bool = True) -> frozenset[str]:
    """The row kinds of a JSONL file (input_ids, messages, prompt), read in chunks: of every row, or
    (not whole) of the complete rows in its first chunk that has one. A malformed row, or no row at
    all, is a UsageError. JSON parsing bounds it: docs/data.md has the speed."""
    rows = RowCheck(path)
    with path.open("rb") as fh:
        while (whole or not rows.kinds) and (chunk := fh.read(CHUNK)):
            rows.feed(chunk)
    if whole or not rows.kinds:  # a last line without a newline; a partial first row is never checked
        rows.close()
    if not rows.kinds:
        raise UsageError(f"{path} has no rows; nothing was pushed")
    return frozenset(rows.kinds)


class RowCheck:
    """Checks a JSONL file's rows as its chunks go by: each non-blank line one JSON object in a row
    format of docs/data.md (training `input_ids`/`loss_mask` or `messages`; regen `prompt`); `kinds`
    collects the formats seen."""

    def __init__(self, path: Path):
        self.path, self.line_no, self.partial = path, 0, b""
        self.kinds: set[str] = set()

    def feed(self, chunk: bytes) -> None:
        """Check the complete lines this chunk ends."""
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            self._line(line)

    def close(self) -> None:
        """Check a last line without a newline."""
        if self.partial:
            self._line(self.partial)

    def _line(self, raw: bytes) -> None:
        self.line_no += 1
        try:
            kind = row_kind(raw)
        except BadRow as exc:
            raise UsageError(
                f"{self.path}:{self.line_no}: {exc}; nothing was pushed (row formats: docs/data.md)"
            ) from None
        if kind:
            self.kinds.add(kind)


def row_kind(raw: bytes) -> str | None:
    """The format of one JSONL line as a dataset row: input_ids, messages or prompt; None for a
    blank line (skipped); BadRow saying what is wrong otherwise."""
    if not raw.strip():
        return None
    if raw.startswith(b"\xef\xbb\xbf"):  # json.loads of bytes skips it; the trainer, reading text, does not
        raise BadRow(
            "a UTF-8 byte-order mark (BOM) before the row, which the trainer refuses: save the file without it"
        )
    try:
        row = json.loads(raw)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise BadRow(f"not JSON ({getattr(exc, 'msg', None) or exc})") from None
    if not isinstance(row, dict):
        raise BadRow(f"a row must be a JSON object, not {type(row).__name__}")
    if "input_ids" in row:
        ids = row["input_ids"]
        if not token_ids(ids):
            raise BadRow(f"input_ids must be a non-empty flat list of {TOKEN_IDS}")
        mask = row.get("loss_mask")
        if mask is not None and (not isinstance(mask, list) or not all(type(m) in (int, bool) for m in mask)):
            raise BadRow("loss_mask must be a flat list of 0/1")
        if mask is not None and len(mask) != len(ids):
            raise BadRow(f"loss_mask has {len(mask)} entries, input_ids {len(ids)}")
        return "input_ids"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRow("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content") or "", str)
            ):
                raise BadRow(f"messages[{i}] must be an object with a string role and string content")
        ids = row.get("reply_ids", [0])  # the target's own reply tokens, from `data regen`
        if not token_ids(ids):
            raise BadRow(f"reply_ids must be a non-empty flat list of {TOKEN_IDS}")
        return "messages"
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise BadRow("prompt must be a string")
        return "prompt"
    raise BadRow("the row has none of input_ids, messages or prompt")


def token_ids(ids: Any) -> bool:
    """Whether a row's ids are a non-empty flat list of token ids: a negative one fails the
    trainer's embedding (on CUDA a device-side assert), only once the run has started."""
    return isinstance(ids, list) and bool(ids) and all(type(t) is int and t >= 0 for t in ids)


def chunks(path: Path, on_bytes: Callable[[int], None]) -> Iterator[bytes]:
    """The file's bytes in chunks, reporting each chunk's size."""
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            on_bytes(len(chunk))
            yield chunk


def _call(target: Target, args: list[str], stdin: Any = None) -> dict[str, Any]:
    result = target.python("data_sync", args, stdin=stdin, timeout=None)
    try:
        answer = json.loads(result.text().strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RemoteError(f"{target.label}: data: no answer: {result.err_line()}") from None
    if "error" in answer:
        raise RemoteError(f"{target.label}: data: {answer['message']}")
    return answer


def check_name(name: str) -> str:
    """A dataset name as `data/` holds it (UsageError otherwise)."""
    if not name or len(name) > 200 or name[0] in "._-" or not set(name) <= NAME_CHARS:
        raise UsageError(f"dataset name {name!r}: letters, digits, '.', '_' and '-' (not first), at most 200")
    if errors_of(name):
        raise UsageError(
            f"dataset name {name!r}: a name ending {ERRORS_SUFFIX} is a data regen's errors file (its failed rows), "
            "not a dataset: choose another"
        )
    return name


def errors_of(name: str) -> str | None:
    """The regen output whose errors file `name` is (X.jsonl for X.errors.jsonl), or None for a dataset."""
    if name.endswith(ERRORS_SUFFIX) and len(name) > len(ERRORS_SUFFIX):
        return name[: -len(ERRORS_SUFFIX)] + ".jsonl"
    return None


def list_data(target: Target) -> list[dict[str, Any]]:
    """The host's files in data/: name, size, rows, sha256, and kind (a dataset, or the errors
    file of a data regen with `errors_of` its output's name)."""
    found = _call(target, ["list", target.host.workdir])["datasets"]
    for entry in found:
        of = errors_of(entry["name"])
        entry.update({"kind": "errors", "errors_of": of} if of else {"kind": "dataset"})
    return found


def push_data(
    target: Target, files: list[Path], as_name: str | None = None, on_bytes: Callable[[int], None] = lambda n: None
) -> list[Pushed]:
    """Send each file to `<workdir>/data/NAME` (NAME: its file name, or `as_name` for one file)."""
    if as_name is not None and len(files) != 1:
        raise UsageError("--as names one file; push several under their own names")
    for path in files:
        if path.is_dir():
            raise UsageError(f"{path} is a directory, not a file")
        if not path.is_file():
            raise UsageError(f"no such file: {path}")
    names = [path.name if as_name is None else as_name for path in files]
    first: dict[str, Path] = {}
    for path, name in zip(files, names):
        check_name(name)
        if name in first:  # both would be sent, the second over the first: one dataset where two were meant
            raise UsageError(
                f"{first[name]} and {path} would both be data:{name} (the second replacing the first); "
                "nothing was pushed: push one of them alone with --as NAME"
            )
        first[name] = path
    digests = [digest(path) for path in files]
    known = {d["name"]: d for d in list_data(target)}
    unchanged = [_same(known.get(name), size, sha) for name, (size, sha) in zip(names, digests)]
    # Every file to be sent is checked whole before any is sent; one the host holds unchanged only
    # for its kinds (and that it has a row).
    kinds = [row_kinds(path, whole=not same) for path, same in zip(files, unchanged)]
    done = []
    for path, name, (size, sha), same, file_kinds in zip(files, names, digests, unchanged, kinds):
        if same:
            done.append(Pushed(name, size, known[name]["rows"], sha, sent=False, kinds=file_kinds))
            continue
        answer = _call(target, ["put", target.host.workdir, name, str(size), sha], stdin=chunks(path, on_bytes))
        done.append(Pushed(name, answer["size"], answer["rows"], answer["sha256"], sent=True, kinds=file_kinds))
    return done


def _same(have: dict[str, Any] | None, size: int, sha: str) -> bool:
    """Whether the host's record of a dataset is these bytes."""
    return bool(have and have["size"] == size and have["sha256"] == sha)
