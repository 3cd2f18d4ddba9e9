"""`runctl list`, `show` and `stop`: what the runs are, and ending one."""

import json
import os
import signal
import time

from ..wire import EXIT, META, METRICS, STOP
from .common import (
    alive,
    emit,
    read_exit_code,
    read_json,
    request_stop,
    runs_root,
    signal_group,
    signal_process,
    write_atomic,
)
from .state import all_runs, resolve, state_of, summary


def cmd_list(workdir):
    """Every run's summary, oldest first."""
    emit({"runs": [summary(d, m) for _, d, m in all_runs(runs_root(workdir))]})


def cmd_show(workdir, selector, max_points="1000"):
    """One run's summary plus its metrics, thinned to at most max_points records (0: none)."""
    _, run_dir, meta = resolve(runs_root(workdir), selector)
    if int(max_points) <= 0:
        out = summary(run_dir, meta)
        out.update(metrics=[], metrics_count=0)
        emit(out)
        return
    records = []
    try:
        with open(os.path.join(run_dir, METRICS), "rb") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a half-written last line
                if isinstance(rec, dict):
                    records.append(rec)
    except OSError:
        pass
    # Thin only the training records: eval records are few, and a fixed stride could skip all of them.
    is_train = [r.get("event", "train") == "train" for r in records]
    stride = max(1, -(-sum(is_train) // int(max_points)))
    train_idx = [i for i, t in enumerate(is_train) if t]
    # The last two stay: `runs show` says which steps the latest tokens/s covers (from the one before).
    keep = set(train_idx[::stride] + train_idx[-2:])
    thinned = [r for i, r in enumerate(records) if i in keep or not is_train[i]]
    out = summary(run_dir, meta)
    out.update(metrics=thinned, metrics_count=len(records))
    emit(out)


def cmd_stop(workdir, selector, grace):
    """Ask the supervisor to stop the run and wait until it has ended."""
    grace = float(grace)
    _, run_dir, meta = resolve(runs_root(workdir), selector)
    state, _ = state_of(run_dir, meta)
    if state not in ("running", "queued"):
        out = summary(run_dir, meta)
        out["already"] = True
        emit(out)
        return
    if not os.path.exists(os.path.join(run_dir, STOP)):
        request_stop(run_dir, grace, "dflashctl runs stop")
    if meta.get("trainer") and not alive(meta.get("supervisor")):
        stop_orphan_trainer(run_dir, meta, grace)
    deadline = time.time() + grace + 30
    while (
        time.time() < deadline
        and read_exit_code(run_dir) is None
        and state_of(run_dir, meta)[0] in ("running", "queued")
    ):
        time.sleep(0.1)
    meta = read_json(os.path.join(run_dir, META)) or meta
    emit(summary(run_dir, meta))


def stop_orphan_trainer(run_dir, meta, grace):
    """The supervisor is gone but the trainer lives: do its job (the exit code is unknowable)."""
    trainer = meta.get("trainer")
    signal_process(trainer["pid"], signal.SIGTERM)  # the trainer only, as wait_trainer does
    deadline = time.time() + grace
    while alive(trainer) and time.time() < deadline:
        time.sleep(0.1)
    code = 128 + signal.SIGKILL if alive(trainer) else 128 + signal.SIGTERM
    signal_group(meta.get("pgid") or trainer["pid"], signal.SIGKILL)  # and whatever is left of its group
    write_atomic(os.path.join(run_dir, EXIT), "%d\n" % code)
