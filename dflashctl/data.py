"""`dflashctl data push/list`: datasets in `<workdir>/data/` in the container (the remote half is
`remote/data_sync.py`). A file is hashed here while it is read in chunks (never held in memory),
skipped when the container already has the same bytes, else streamed into a hidden partial file
there and renamed over the old copy only once its size and sha256 check out. docs/data.md."""

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


@dataclass(frozen=True)
class Pushed:
    """One dataset after a push: its name, size, rows, hash, and whether bytes travelled."""

    name: str
    size: int
    rows: int
    sha256: str
    sent: bool


def digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


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
    return name


def list_data(target: Target) -> list[dict[str, Any]]:
    """The host's datasets: name, size, rows, sha256."""
    return _call(target, ["list", target.host.workdir])["datasets"]


def push_data(target: Target, files: list[Path], as_name: str | None = None,
              on_bytes: Callable[[int], None] = lambda n: None) -> list[Pushed]:
    """Send each file to `<workdir>/data/NAME` (NAME: its file name, or `as_name` for one file)."""
    if as_name is not None and len(files) != 1:
        raise UsageError("--as names one file; push several under their own names")
    for path in files:
        if not path.is_file():
            raise UsageError(f"no such file: {path}")
    names = [as_name or path.name for path in files]
    for name in names:
        check_name(name)
    known = {d["name"]: d for d in list_data(target)}
    done = []
    for path, name in zip(files, names):
        size, sha = digest(path)
        have = known.get(name)
        if have and have["size"] == size and have["sha256"] == sha:
            done.append(Pushed(name, size, have["rows"], sha, sent=False))
            continue
        answer = _call(target, ["put", target.host.workdir, name, str(size), sha], stdin=chunks(path, on_bytes))
        done.append(Pushed(name, answer["size"], answer["rows"], answer["sha256"], sent=True))
    return done
