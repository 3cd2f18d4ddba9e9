"""Compiled bytecode for torch when its install has none (issue 31: warm start).

An install without `.pyc` files beside its sources (uv's default, `pip --no-compile`) where Python
may not write them (`PYTHONDONTWRITEBYTECODE`, a read-only environment) compiles torch's source at
every start: 11-13 s of importing torch, Dynamo and Inductor on the H200 machine (0 of 2,141 files
compiled), against 6.6-8 s with bytecode on a 2-core CPU box that needed 17-30 s without. Keeping
it under the workdir makes every start after the first read it instead. Standard library only: it
runs before torch is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path


def keep_bytecode(directory: str | None, package: str = "torch") -> str | None:
    """Before `package` is imported: when no bytecode sits beside its source and Python will not
    write it there, read and write it under `directory` (this process and its children); the
    decision as a start-up line, or None when there is nothing to decide."""
    if directory is None:
        return None
    if sys.pycache_prefix:
        return f"bytecode: {sys.pycache_prefix} (PYTHONPYCACHEPREFIX from the environment)"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None  # not installed (its own error comes later) or not from source
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None  # compiled at install: Python reads it as always
    source_dir = os.path.dirname(spec.origin)
    if not sys.dont_write_bytecode and os.access(source_dir, os.W_OK):
        return None  # Python writes it beside the source at this first import
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else f"{source_dir} is read-only"
    cache = Path(directory).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    sys.pycache_prefix, sys.dont_write_bytecode = str(cache), False
    # Children (Inductor's compile workers, the warm-up process) start with the same choice.
    os.environ["PYTHONPYCACHEPREFIX"] = str(cache)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    warm = os.path.exists(importlib.util.cache_from_source(spec.origin))
    state = "warm: kept from earlier starts" if warm else "cold: this start fills it"
    return (
        f"bytecode cache: {cache} ({state}; {package} was installed without compiled bytecode and "
        f"{why}: each start would compile its source again)"
    )


def keep_bytecode_saying(directory: str | None, say: Callable[[str], None]) -> None:
    """keep_bytecode, with its start-up line (if any) handed to `say` at once."""
    kept = keep_bytecode(directory)
    if kept:
        say(kept)
