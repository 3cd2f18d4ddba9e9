"""Helpers shared by test_runs.py and test_logs.py: the stand-in payload, waiting, process counts."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from dflashctl.inventory import parse_inventory
from dflashctl.session import Session

STANDIN = Path(__file__).parent / "standin_trainer.py"


def install_standin(payload: Path) -> Path:
    """Make `payload/dflash_train` the stand-in trainer, as `python -m dflash_train` finds it."""
    pkg = payload / "dflash_train"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(STANDIN, pkg / "__main__.py")
    return payload


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for its parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    """Poll predicate until it is truthy (returns it) or fail after timeout (a bound, not a timing check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_dir(workdir: Path, run_id: str) -> Path:
    """Where a run lives."""
    return workdir / "runs" / run_id


def meta(workdir: Path, run_id: str) -> dict:
    """The run's run.json."""
    return json.loads((run_dir(workdir, run_id) / "run.json").read_text())


def ended_run(workdir: Path, run_id: str, code: int, **fields: object) -> Path:
    """A run directory as runctl leaves a run that ended with exit `code` (no process left), written
    by the test: run.json has these fields over a training run's few; list, show and resume read it."""
    path = run_dir(workdir, run_id)
    path.mkdir(parents=True)
    record = {"run_id": run_id, "kind": "train", "host": "local", "gpus": [], "started_ts": 1796119200.0, **fields}
    (path / "run.json").write_text(json.dumps(record))
    (path / "exit_code").write_text(f"{code}\n")
    return path


def pids_where(match: Callable[[list[bytes]], bool]) -> list[int]:
    """Pids of the processes whose command line (its arguments, from /proc) `match` accepts."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(args):
            found.append(int(entry.name))
    return found


def readers(workdir: Path) -> list[int]:
    """Pids of `runctl read` processes for this workdir (remote log readers)."""
    # python -c LAUNCHER AGENT_ROOT runctl read WORKDIR ... (dflashctl/agent.py)
    wanted = [b"runctl", b"read", os.fsencode(str(workdir))]
    return pids_where(lambda args: args[1:2] == [b"-c"] and args[4:7] == wanted)


def local_env(tmp_path: Path) -> dict[str, str]:
    """run_cli's environment for a `local` default host whose work directory is tmp_path/wd."""
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        f"default: local\nhosts:\n  local: {{transport: local, workdir: {json.dumps(str(tmp_path / 'wd'))}}}\n"
    )
    return {"DFLASHCTL_INVENTORY": str(inventory)}


def local_session(workdir: Path) -> Session:
    """A Session whose default host is this machine with the given workdir."""
    text = f"default: local\nhosts:\n  local: {{transport: local, workdir: {json.dumps(str(workdir))}}}\n"
    return Session(parse_inventory(text))


def race(*starts: Callable[[], object]) -> tuple[object, list[Exception]]:
    """Run the starts at once, one thread each: (the one that succeeded, the ConflictErrors of the
    others). Which one wins is up to the threads; that exactly one does is the rule under test."""
    import threading

    from dflashctl.errors import ConflictError

    results: list[object] = []

    def attempt(start: Callable[[], object]) -> None:
        try:
            results.append(start())
        except ConflictError as exc:
            results.append(exc)

    threads = [threading.Thread(target=attempt, args=(start,)) for start in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (winner,) = [r for r in results if not isinstance(r, Exception)]
    return winner, [r for r in results if isinstance(r, ConflictError)]
