"""The supervisor of one run: waits in the queue if it must, runs the program, honours stop
requests, restarts it after a crash when the run asked for that, records its exit code."""

import os
import shlex
import signal
import subprocess
import sys
import time

from ..wire import AGREED_STOP, EXIT, LOG, META, NO_RESTART, REASON, STOP
from .common import (
    SUPERVISOR_POLL_S,
    marker,
    read_json,
    request_stop,
    runs_lock,
    signal_group,
    signal_process,
    update_meta,
    utc_iso,
    write_atomic,
)
from .forking import start_trainer
from .hooks import end_hooks, fire
from .state import conflicts, newest_checkpoint, queued_ahead, read_reason, state_of


RESTART_DELAY_CAP_S = 300.0
QUEUE_POLL_S = 1.0  # how often a queued run looks whether its GPUs are free


def supervise(run_dir, meta, env):
    """Run the trainer, honour stop requests, restart it from its newest checkpoint after a crash
    when the run asked for restarts, and record its exit code (128+N for signal N)."""
    stop_flag = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop_flag.append(1))
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    child_env["DFLASHCTL_REASON_FILE"] = os.path.join(run_dir, REASON)
    child_env["DFLASHCTL_AGREED_STOP_FILE"] = os.path.join(run_dir, AGREED_STOP)
    if meta.get("queued"):
        update_meta(run_dir, supervisor=marker(os.getpid()))
        print(
            "dflashctl: queued behind %s for GPUs %s"
            % (", ".join(meta.get("queued_behind") or []), ",".join(meta["gpus"])),
            flush=True,
        )
        if not wait_in_queue(run_dir, meta, stop_flag):
            print("dflashctl: the queued run was cancelled before it started", flush=True)
            write_atomic(os.path.join(run_dir, EXIT), "%d\n" % (128 + signal.SIGTERM))
            end_hooks([fire(run_dir, meta, "stopped", "stopped", 128 + signal.SIGTERM)])
            return 0
    hooks = []  # each attempt's `started`/`restarted` hook: stopped at the end if still running
    ended = run_attempts(run_dir, meta, child_env, stop_flag, hooks)
    if ended is not None:
        finish(run_dir, meta, *ended, hooks)
    else:
        end_hooks(hooks)
    return 0


def run_attempts(run_dir, meta, child_env, stop_flag, hooks):
    """Run the trainer, again after each crash the run's restart policy covers; (exit code, where
    the last attempt's output starts in the log), or None when it could not be started (exit 127
    recorded)."""
    restart = meta.get("restart") or {}
    argv, failed_at, attempt = list(meta["argv"]), None, 0
    workdir = os.path.dirname(os.path.dirname(run_dir))  # run_dir is <workdir>/runs/<run-id>
    while True:
        attempt += 1
        log_from = os.fstat(1).st_size  # where this attempt's output starts (stdout is the log)
        try:
            child, how = start_trainer(argv, meta["cwd"], child_env, meta.get("fork_server_s", 0), workdir)
        except OSError as exc:
            sys.stderr.write("dflashctl: cannot start the trainer: %s\n" % exc)
            sys.stderr.flush()
            update_meta(run_dir, supervisor=marker(os.getpid()))
            write_atomic(os.path.join(run_dir, EXIT), "127\n")
            return None
        update_meta(run_dir, supervisor=marker(os.getpid()), trainer=marker(child.pid), pgid=child.pid, start=how)
        hooks.append(fire(run_dir, meta, "restarted" if attempt > 1 else "started", "running"))
        code = wait_trainer(run_dir, child, stop_flag)
        adopt_agreed_stop(run_dir, code)
        step = newest_checkpoint(run_dir)
        done = (read_json(os.path.join(run_dir, META)) or {}).get("restarts", 0)
        if not wants_restart(restart, code, done) or stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            return code, log_from
        if step is not None and step == failed_at:
            print(
                "dflashctl: the trainer failed again (exit %d) without getting past its checkpoint at step %s: "
                "not restarting" % (code, step),
                flush=True,
            )
            return code, log_from
        failed_at = step
        delay = min(RESTART_DELAY_CAP_S, float(restart.get("delay_s", 10)) * 2**done)
        print(
            "dflashctl: restart %d/%d after exit code %d, from %s, in %g s"
            % (
                done + 1,
                restart["max"],
                code,
                "the checkpoint at step %s" % step if step is not None else "the start",
                delay,
            ),
            flush=True,
        )
        update_meta(
            run_dir, restarts=done + 1, last_restart={"exit_code": code, "checkpoint": step, "at": utc_iso(time.time())}
        )
        if sleep_unless_stopped(run_dir, delay, stop_flag):
            return code, log_from
        if step is not None and "--resume" not in argv:
            argv.append("--resume")


def adopt_agreed_stop(run_dir, code):
    """A trainer that stopped because its group agreed to (a stop asked of another node; it leaves
    AGREED_STOP) was stopped on request: record the request as `runs stop` would have, so that the
    node's state is `stopped`, not `failed (143)`, and no restart follows."""
    path = os.path.join(run_dir, AGREED_STOP)
    if code != 128 + signal.SIGTERM or os.path.exists(os.path.join(run_dir, STOP)) or not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        note = fh.read().strip()
    request_stop(run_dir, 0.0, "the group's stop agreement: %s" % note)


def finish(run_dir, meta, code, log_from, hooks):
    """After the last attempt: the hint to continue, the reason from the log, the exit code, the
    final event (whose hook gets HOOK_WAIT_S; then no hook of the run is left running)."""
    if code not in (0, 2) and meta.get("host") and meta.get("kind") == "data":
        # A regen keeps every row it wrote: --resume goes on at the first missing one.
        command = shlex.join(["dflashctl", "data", "regen", meta["host"], "--resume", meta["run_id"]])
        print("dflashctl: regen exited with %d; continue where it stopped: %s" % (code, command), flush=True)
    elif code not in (0, 2) and meta.get("host") and not meta.get("group") and newest_checkpoint(run_dir) is not None:
        # The trainer's own hint names its flag; this one names the command that does it here.
        command = shlex.join(["dflashctl", "train", meta["host"], "--resume", meta["run_id"]])
        print(
            "dflashctl: the trainer exited with %d; continue from its newest checkpoint: %s" % (code, command),
            flush=True,
        )
    if code != 0 and read_reason(run_dir) is None and not os.path.exists(os.path.join(run_dir, STOP)):
        line = error_line(os.path.join(run_dir, LOG), log_from)
        if line:  # `runs show` says why it failed without a look into the log
            write_atomic(os.path.join(run_dir, REASON), line + "\n")
    write_atomic(os.path.join(run_dir, EXIT), "%d\n" % code)
    state = state_of(run_dir, read_json(os.path.join(run_dir, META)) or meta)[0]
    end_hooks([*hooks, fire(run_dir, meta, state, state, code)])


def wait_in_queue(run_dir, meta, stop_flag):
    """A queued run's supervisor: poll until no running run holds its GPUs and no earlier queued run
    wants them, then leave the queue under the runs lock (so two starts cannot both win).
    False when a stop came first."""
    root = os.path.dirname(run_dir)
    while True:
        if stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            return False
        with runs_lock(root):
            if not conflicts(root, meta["gpus"]) and not queued_ahead(root, meta["gpus"], meta["run_id"]):
                now = time.time()
                update_meta(run_dir, queued=False, dequeued_at=utc_iso(now), dequeued_ts=now)
                print("dflashctl: GPUs %s free: starting" % ",".join(meta["gpus"]), flush=True)
                return True
        time.sleep(QUEUE_POLL_S)


def error_line(log_path, start):
    """The trainer's last `error: ...` line in the log from byte `start` on (its last 64 kB), else
    the last line of a Python traceback there; None if neither."""
    try:
        with open(log_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(start if start <= size else 0, size - 65536))
            lines = [ln.decode("utf-8", "replace").strip() for ln in fh.read().splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if errors:
        return errors[-1][len("error: ") :][:2000]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        last = [ln for ln in lines if not ln.startswith("dflashctl: ")]
        return last[-1][:2000] if last else None
    return None


def wants_restart(restart, code, done):
    """Whether a run that asked for restarts gets one more after this exit code."""
    if not restart or done >= restart.get("max", 0):
        return False
    listed = restart.get("on")
    return code in listed if listed else code not in NO_RESTART


def sleep_unless_stopped(run_dir, seconds, stop_flag):
    """Wait out a restart delay; True when a stop came meanwhile (the run then ends as it stood)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            return True
        time.sleep(SUPERVISOR_POLL_S)
    return False


def wait_trainer(run_dir, child, stop_flag):
    """Wait for the trainer; on a stop request SIGTERM the trainer, then SIGKILL its group after the
    grace. Only the trainer gets SIGTERM: its helpers (the compiler's ptxas and workers, warm-up or
    rank processes it stops itself) must not die under it while it winds down, or it logs their
    failure (a whole PTX dump for a ptxas killed mid-compile)."""
    kill_at = None
    while True:
        try:
            rc = child.wait(timeout=SUPERVISOR_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if stop_flag and not os.path.exists(os.path.join(run_dir, STOP)):
            request_stop(run_dir, 60.0, "signal to supervisor")
        req = read_json(os.path.join(run_dir, STOP))
        if req is not None and kill_at is None:
            signal_process(child.pid, signal.SIGTERM)
            kill_at = time.time() + float(req.get("grace", 60))
        elif kill_at is not None and time.time() >= kill_at:
            signal_group(child.pid, signal.SIGKILL)
            kill_at = float("inf")
    # Leftovers of the trainer's group (compiler workers...) must not hold the GPUs.
    signal_group(child.pid, signal.SIGKILL)
    return rc if rc >= 0 else 128 - rc
