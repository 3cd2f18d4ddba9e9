"""Remote side of dflashctl's guarded commands (`exec`, `runctl start`): runs a command in a
session of its own, so that an interrupted call can reach the command and everything it started
through a second session (over SSH without a terminal, closing the channel sends the command no
signal: it would run on). Stdlib only.

    python -S -c <this source> run TOKEN ARGV...   run ARGV; exit as it exits (255: killed by a signal)
    python -S -c <this source> stop TOKEN          end what `run TOKEN` started
    python -S -c <this source> interrupt TOKEN     send it SIGINT once, as a terminal's Ctrl-C would

`run` forks: the child starts a new session (its pid names it) and execs ARGV with the caller's
stdin, stdout and stderr untouched, so every byte and the exit code are the command's own. The
parent drops its copies of the streams, ignores the terminal's SIGINT and SIGQUIT (a `local` exec
shares the terminal), waits, and exits with the child's code, or with 255 when a signal killed the
child: what ssh reports for that, and an exit status, which sshd sends and the client reads at once
(dying of the signal made sshd send `exit-signal`, which paramiko ignores: the client learnt of the
end only when the channel closed, then waited a second to tell it from a dropped connection).

`stop` first leaves a mark (STOPPED, in /tmp) that a `run TOKEN` not started yet obeys: its child
checks it after starting its session and before the exec, so a Ctrl-C a moment after the call
began cannot miss a command that was about to start (`run` removes the mark when it ends; a stop
that came after its command had ended leaves it, an empty file, which the next `run` to end on
that machine removes once it is MARK_TTL_S old). Then it finds the `run TOKEN` parent in
/proc and signals every process of its child's session:
SIGINT, then SIGTERM after INT_GRACE_S, then SIGKILL after TERM_GRACE_S more (each of the first
two followed by SIGCONT, as systemd does, so a stopped process handles it), and returns once
none is left (a zombie counts as gone); exit 0, or 1 when something outlived SIGKILL_WAIT_S. A
SIGTERM or SIGHUP to `stop` itself (a second Ctrl-C) skips to SIGKILL. A process that started a
session of its own (a daemon) left on purpose and is not touched.
"""

import os
import signal
import sys
import time

EXIT_SIGNALLED = 255  # the command was killed by a signal (as ssh reports it)
INT_GRACE_S = 2.0
TERM_GRACE_S = 3.0
SIGKILL_WAIT_S = 10.0
POLL_S = 0.05
STOPPED = "/tmp/dflashctl-guard-%s.stopped"
# A mark is read within the second of its stop; one left by a stop that came too late is removed
# by the next `run` once it is this old.
MARK_TTL_S = 600.0


def run(token, argv):
    """Run argv in a new session; returns its exit code (EXIT_SIGNALLED when a signal killed it)."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if os.path.exists(STOPPED % token):  # the stop came first (and found no session to signal)
                os._exit(130)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the command must not
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as exc:
            missing = isinstance(exc, FileNotFoundError)
            why = "command not found" if missing else (exc.strerror or str(exc))
            os.write(2, os.fsencode(argv[0]) + b": " + why.encode() + b"\n")
            os._exit(127 if missing else 126)
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _, status = os.waitpid(child, 0)
    try:
        os.unlink(STOPPED % token)
    except OSError:
        pass
    sweep_marks()
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else EXIT_SIGNALLED


def sweep_marks():
    """Remove marks older than MARK_TTL_S: those of stops that came after their command had ended."""
    import glob

    for path in glob.glob(STOPPED % "*"):
        try:
            if time.time() - os.stat(path).st_mtime > MARK_TTL_S:
                os.unlink(path)
        except OSError:
            pass


def processes():
    """{pid: (ppid, session, state)} of every process this user can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after `pid (comm) `, comm may hold anything
        table[int(name)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


def is_run(pid, token):
    """Whether pid is this script's `run TOKEN`."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            parts = fh.read().split(b"\0")
    except OSError:
        return False
    if b"-c" not in parts:
        return False
    at = parts.index(b"-c")
    return parts[at + 2 : at + 4] == [b"run", os.fsencode(token)]


def members(sessions):
    """Live (not zombie) pids of these sessions."""
    return {pid for pid, (_, sid, state) in processes().items() if sid in sessions and state != b"Z"}


def sessions_of(token):
    """The sessions that `run TOKEN` started (one; none once it has ended)."""
    table = processes()
    runs = {pid for pid in table if is_run(pid, token)}
    return {pid for pid, (ppid, sid, _) in table.items() if ppid in runs and sid == pid}


def interrupt(token):
    """SIGINT to every process of the session that `run TOKEN` started; returns 0."""
    for pid in members(sessions_of(token)):
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass
    return 0


def stop(token):
    """Signal the session that `run TOKEN` started until none of it is left; returns the exit code."""
    hurry = []
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: hurry.append(1))
    try:
        open(STOPPED % token, "w").close()  # before the look in /proc (see the module's docstring)
    except OSError:
        pass
    sessions = sessions_of(token)
    for sig, grace in ((signal.SIGINT, INT_GRACE_S), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, SIGKILL_WAIT_S)):
        signalled = set()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (sig == signal.SIGKILL or not hurry):
            left = members(sessions)
            if not left:
                return 0
            for pid in left - signalled:  # a process forked since the last look gets it too
                try:
                    os.kill(pid, sig)
                    if sig != signal.SIGKILL:  # a stopped process (Ctrl-Z, SIGSTOP) acts on it only once continued
                        os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            signalled |= left
            time.sleep(POLL_S)
    return 0 if not members(sessions) else 1


def main(argv):
    """`run TOKEN ARGV...`, `stop TOKEN` or `interrupt TOKEN`; returns the exit code."""
    token = argv[1] if len(argv) >= 2 and argv[1].isalnum() else None  # it names a file in /tmp
    if token and argv[0] == "run" and len(argv) >= 3:
        return run(token, [os.fsencode(a) for a in argv[2:]])
    if token and argv[0] in ("stop", "interrupt") and len(argv) == 2:
        return (stop if argv[0] == "stop" else interrupt)(token)
    sys.stderr.write("guard: usage: run TOKEN ARGV... | stop TOKEN | interrupt TOKEN\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
