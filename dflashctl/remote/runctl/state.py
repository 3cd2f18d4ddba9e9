"""What a run is now, read from its directory: state, latest metrics, reason, and which run a
selector names; what holds which GPUs."""

import json
import os
import re
import shlex
import time

from ..wire import EVAL, EXIT, LOG, META, METRICS, REASON, STOP
from .common import LOST_EVENT, RunError, alive, read_exit_code, read_json
from .hooks import fire


STARTING_GRACE_S = 60.0  # a run.json without pids is "starting" this long, then "lost"


def state_of(run_dir, meta):
    """queued | running | succeeded | failed | stopped | lost, and the exit code if known."""
    code = read_exit_code(run_dir)
    if code is None:
        if meta.get("supervisor") is None:
            # Starting: its starter (runctl start) forks the supervisor. A starter killed before
            # that (kill -9, a client that went away) leaves a run that is lost at once.
            starting = (
                alive(meta["starter"])
                if meta.get("starter")
                else time.time() - meta.get("started_ts", 0) < STARTING_GRACE_S
            )
            return ("running" if starting else "lost"), None
        if alive(meta.get("supervisor")) or alive(meta.get("trainer")):
            # A queued run's supervisor waits for its GPUs; run.json says when it stopped waiting.
            return ("queued" if meta.get("queued") else "running"), None
        code = read_exit_code(run_dir)  # it may have ended between the two reads
        if code is None:
            return "lost", None
    if os.path.exists(os.path.join(run_dir, STOP)):
        return "stopped", code
    return ("succeeded" if code == 0 else "failed"), code


def tail_lines(path, limit=65536):
    """The complete lines in the last `limit` bytes of a file (none if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return []
    # The piece after the last newline is a record still being written: never use it.
    return [ln for ln in data.split(b"\n")[:-1] if ln.strip()]


def last_metrics(run_dir):
    """The latest training record, with the latest acceptance length of any record merged in
    (the trainer logs acceptance on its eval records, whose loss is the held-out one); None before
    the first training record (a progress line of the untrained drafter's eval alone has no step)."""
    merged, trained = {}, False
    for line in tail_lines(os.path.join(run_dir, METRICS)):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("event", "train") == "train":
            trained = True
            merged.update((k, v) for k, v in rec.items() if v is not None)
        else:
            for key in ("acceptance_length", "spec_tau", "spec_tau_prompt_mean"):  # eval records: held-out figures
                if rec.get(key) is not None:
                    merged[key] = rec[key]
    return merged if trained else None


def read_reason(run_dir):
    """The failure reason the trainer recorded (first 2000 characters), or None."""
    try:
        with open(os.path.join(run_dir, REASON), encoding="utf-8", errors="replace") as fh:
            return fh.read(2000).strip() or None
    except OSError:
        return None


def summary(run_dir, meta):
    """What `runs list` shows of one run."""
    state, code = state_of(run_dir, meta)
    ended = None
    try:
        ended = os.stat(os.path.join(run_dir, EXIT)).st_mtime
    except OSError:
        pass
    if state == "lost":
        report_lost(run_dir, meta)
    out = dict(meta)
    out.setdefault("kind", "train")  # run.json from before kinds
    out.update(
        state=state,
        exit_code=code,
        ended_ts=ended,
        last=last_metrics(run_dir),
        now_ts=time.time(),
        reason=read_reason(run_dir) if state != "running" else None,
        eval=eval_figures(run_dir, EVAL),
        evals=other_evals(run_dir),
    )
    return out


def report_lost(run_dir, meta):
    """The `lost` event, once: nobody is left to notice the loss but whoever looks next (this call)."""
    if not meta.get("on_event"):
        return
    try:
        os.close(os.open(os.path.join(run_dir, LOST_EVENT), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        return  # reported already (or by a concurrent call)
    fire(run_dir, meta, "lost", "lost", log=os.path.join(run_dir, LOG))


def eval_figures(run_dir, name):
    """The headline of a `dflashctl eval` report (eval.json: on the run's own prompts), or None
    before one was made."""
    report = read_json(os.path.join(run_dir, name))
    if not isinstance(report, dict):
        return None
    keys = (
        "tau",
        "tau_prompt_mean",
        "speedup",
        "identical",
        "prompts",
        "prompts_source",  # absent (None) from reports written before eval recorded it
        "max_new_tokens",
        "device",
        "temperature",
    )
    figures = {k: report.get(k) for k in keys}
    baseline = report.get("baseline")
    if isinstance(baseline, dict):  # prompt lookup on the same decode path (eval's default)
        figures["baseline"] = {k: baseline.get(k) for k in ("method", "tau", "tau_prompt_mean", "speedup")}
    return figures


def other_evals(run_dir):
    """{prompts name: headline} of `dflashctl eval --prompts FILE`'s reports, eval-<FILE's stem>.json."""
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return {}
    found = {}
    for name in names:
        if name.startswith("eval-") and name.endswith(".json"):
            figures = eval_figures(run_dir, name)
            if figures is not None:
                found[name[len("eval-") : -len(".json")]] = figures
    return found


def all_runs(root):
    """(run_id, run_dir, meta) for every run, oldest first (run ids sort by start time)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for name in names:
        run_dir = os.path.join(root, name)
        meta = read_json(os.path.join(run_dir, META))
        if isinstance(meta, dict):
            found.append((name, run_dir, meta))
    return found


def resolve(root, selector):
    """The run named by selector: '' = latest, else exact id, unique id prefix, or exact name."""
    runs = all_runs(root)
    if not runs:
        raise RunError("not_found", "no runs yet")
    if not selector:
        return runs[-1]
    exact = [r for r in runs if r[0] == selector]
    if exact:
        return exact[0]
    matches = [r for r in runs if r[0].startswith(selector)] or [r for r in runs if r[2].get("name") == selector]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunError("not_found", "no run matches %r" % selector)
    raise RunError("ambiguous", "%r matches %d runs" % (selector, len(matches)), candidates=[r[0] for r in matches])


def resume_refusal(run_id, meta, state, kind=None):
    """Why a run's record refuses a resume as `kind` (train | data; None: either), as a RunError,
    or None: a live run, a run that succeeded, a run of the other kind. runctl resume asks under its
    lock; the client asks of `runs show`'s answer before it pushes anything, so both refuse with
    the same line."""
    if state in ("running", "queued"):
        return RunError("conflict_running", "run %s is still %s (stop it first: dflashctl runs stop)" % (run_id, state))
    recorded = meta.get("kind") or "train"
    if state == "succeeded":
        # Its output is complete: a resume only moved its record's start (a data run whose output
        # was removed since made it again from row 0; a trainer at run.steps has nothing to train).
        out = (meta.get("config") or {}).get("out") if recorded == "data" else None
        wrote = " (it wrote data:%s)" % out if out else ""
        return RunError("conflict_state", "run %s already succeeded: nothing to resume%s" % (run_id, wrote))
    if kind and kind != recorded:
        how = ["dflashctl", "data", "regen"] if recorded == "data" else ["dflashctl", "train"]
        return RunError(
            "usage",
            "run %s is a %s run: continue it with %s"
            % (run_id, recorded, shlex.join(how + [meta.get("host") or "HOST", "--resume", run_id])),
        )
    return None


def named(root, name):
    """The newest run called name as (run_id, run_dir, meta), or None."""
    found = [r for r in all_runs(root) if r[2].get("name") == name]
    return found[-1] if found else None


def conflicts(root, gpus):
    """Live runs that hold any of these GPUs: [(run_id, name, shared gpus)]."""
    wanted = set(gpus)
    found = []
    for run_id, run_dir, meta in all_runs(root):
        shared = wanted & set(meta.get("gpus") or [])
        if shared and state_of(run_dir, meta)[0] == "running":  # a queued run holds nothing yet
            found.append((run_id, meta.get("name"), sorted(shared)))
    return found


def queued_ahead(root, gpus, run_id):
    """Queued runs before run_id (run ids sort by time: FIFO) that want any of these GPUs."""
    wanted = set(gpus)
    found = []
    for rid, run_dir, meta in all_runs(root):
        shared = wanted & set(meta.get("gpus") or [])
        if rid < run_id and shared and state_of(run_dir, meta)[0] == "queued":
            found.append((rid, meta.get("name"), sorted(shared)))
    return found


def checkpoint_key(name):
    """Sort key of a checkpoint entry: its step number (step_00000012, step-12.json), then name."""
    digits = re.findall(r"\d+", name)
    return (int(digits[-1]) if digits else -1, name)


def newest_checkpoint(run_dir):
    """The step of the run's newest complete checkpoint (hidden entries are half-written), or None."""
    try:
        names = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if not n.startswith(".")]
    except OSError:
        return None
    steps = [checkpoint_key(n)[0] for n in names]
    steps = [s for s in steps if s >= 0]
    return max(steps) if steps else None
