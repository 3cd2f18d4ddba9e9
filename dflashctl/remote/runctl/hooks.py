"""A run's event hook (`--on-event`): run with what happened in its environment, never through a
shell; its output reaches the run's log line by line, each line whole."""

import os
import signal
import subprocess
import time


HOOK_WAIT_S = 30.0  # how long the supervisor waits for the last event's hook before it exits
HOOK_POLL_S = 0.05


class Hook:
    """A hook's relay process (see fire): the part of subprocess.Popen that end_hooks uses."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        """Its exit status once it has ended (and is reaped), else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        return self.returncode

    def wait(self, timeout):
        """Its exit status; subprocess.TimeoutExpired when it still runs after timeout seconds."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(HOOK_POLL_S)
        return self.returncode


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
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if log else 1
    try:
        os.write(out, ("dflashctl: event %s\n" % event).encode())
        # A process of its own between the hook and the log: the hook writes to it through a pipe, and it
        # writes each line whole, so no other writer's line lands inside one. Forked, not started
        # afresh: this agent's files may be pruned under a long run (agent.py keeps the newest few).
        pid = os.fork()
        if pid == 0:
            _relay_process(argv, env, run_dir, out, ("[hook %s] " % event).encode())
        return Hook(pid)
    finally:
        if log:
            os.close(out)


def _relay_process(argv, env, cwd, out, prefix):
    """The forked relay: its own session (the hook's too, so that end_hooks stops both), the log
    as its only descriptor besides /dev/null; runs the hook and exits with its code. Never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, 65536)  # the caller's others (an SSH channel's pipes, the runs lock) stay theirs
        code = relay(argv, env, cwd, prefix)
    finally:
        os._exit(code)


def relay(argv, env, cwd, prefix):
    """Run the hook with its stdout and stderr on a pipe and write each line of it to stdout in one
    write, after prefix (a last line without its newline gets one); the hook's exit code."""
    try:
        hook = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as exc:
        os.write(1, ("dflashctl: the event hook cannot start: %s\n" % exc).encode())
        return 127
    # A stop of the session (end_hooks) is the hook's: its last words are still passed on; SIGKILL ends both.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in hook.stdout:
        os.write(1, prefix + (line if line.endswith(b"\n") else line + b"\n"))
    return hook.wait()


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
