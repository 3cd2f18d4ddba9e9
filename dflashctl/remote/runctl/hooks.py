"""A run's event hook (`--on-event`): run with what happened in its environment, never through a shell."""

import os
import signal
import subprocess
import sys


HOOK_WAIT_S = 30.0  # how long the supervisor waits for the last event's hook before it exits


def fire(run_dir, meta, event, state, code=None, log=None):
    """Run the run's event hook, if it has one, with what happened in its environment; never
    through a shell, never waited for here (the caller may). Its output goes to the run's log
    (the supervisor's stdout is the log; `log` names it for a caller whose stdout is not)."""
    argv = meta.get("on_event")
    if not argv:
        return None
    env = dict(
        os.environ,
        DFLASHCTL_EVENT=event,
        DFLASHCTL_RUN_ID=meta["run_id"],
        DFLASHCTL_RUN_NAME=meta.get("name") or "",
        DFLASHCTL_STATE=state,
        DFLASHCTL_EXIT_CODE="" if code is None else str(code),
        DFLASHCTL_HOST=meta.get("host") or "",
        DFLASHCTL_RUN_DIR=run_dir,
    )
    note = "dflashctl: event %s\n" % event
    out = open(log, "ab") if log else None  # never this process's stdout there: it carries the answer
    try:
        if out:
            out.write(note.encode())
            out.flush()
        else:
            sys.stdout.write(note)
            sys.stdout.flush()
        return subprocess.Popen(
            argv,
            cwd=run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            stdout=out,
            stderr=out,
            close_fds=True,
        )
    except OSError as exc:
        if not out:
            print("dflashctl: the event hook cannot start: %s" % exc, flush=True)
        return None
    finally:
        if out:
            out.close()


def end_hooks(hooks):
    """The run's end: give the last event's hook HOOK_WAIT_S to report before the supervisor goes
    (and a follow ends: it waits for SUPERVISED), then stop every hook still running (its session:
    SIGTERM, SIGKILL 2 s later) rather than leave it on the host, and say so in the log."""
    live = [hook for hook in hooks if hook is not None]
    if live:
        try:
            live[-1].wait(timeout=HOOK_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    for hook in live:
        if hook.poll() is None:
            print("dflashctl: an event hook (pid %d) still ran at the run's end: stopped" % hook.pid, flush=True)
            _stop_session(hook)


def _stop_session(hook):
    """SIGTERM to the hook's session (it was started in one of its own), SIGKILL if it is still there 2 s later."""
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(hook.pid, sig)
        except OSError:
            return
        try:
            hook.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
