"""Small helpers every runctl command uses: answers, files written atomically, the runs lock, and
process identity that survives pid reuse."""

import contextlib
import json
import os
import re
import sys
import time

from ..wire import EXIT, META, STOP


LOCK = ".lock"  # under <workdir>/runs: held by a start, a resume, and a queued run leaving its queue
SUPERVISED = ".supervisor_done"  # the supervisor wrote its last byte (after the final hook): a follow may end
LOST_EVENT = ".lost_event"  # exists once the `lost` event was fired
SUPERVISOR_POLL_S = 0.2
RUN_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,99}$")


class RunError(Exception):
    """An answer that is an error: kind (not_found, ambiguous, conflict), message, extra fields."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.answer = dict(error=kind, message=message, **extra)


def emit(obj):
    """Print one JSON answer and flush."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_json(path):
    """A JSON file's content, or None if missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_atomic(path, text):
    """Write via a temp file and rename, so readers never see half a file."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def read_exit_code(run_dir):
    """The recorded exit code, or None while the run has none."""
    try:
        with open(os.path.join(run_dir, EXIT)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def runs_root(workdir):
    """`<workdir>/runs`, with ~ expanded here, inside the container."""
    return os.path.join(os.path.expanduser(workdir), "runs")


def utc_iso(ts):
    """A timestamp as `2026-11-30T11:30:00Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@contextlib.contextmanager
def runs_lock(root):
    """Hold `<root>/.lock` exclusively (flock): starts, resumes and queue exits take turns. Yields
    the open file (a forked supervisor must close it: the lock lives on the open file)."""
    import fcntl

    with open(os.path.join(root, LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock


def update_meta(run_dir, **fields):
    """Merge fields into run.json (atomically)."""
    path = os.path.join(run_dir, META)
    meta = read_json(path) or {}
    meta.update(fields)
    write_atomic(path, json.dumps(meta, indent=2))


def request_stop(run_dir, grace, reason):
    """Record a stop request; the supervisor acts on it."""
    write_atomic(os.path.join(run_dir, STOP), json.dumps({"grace": grace, "at": utc_iso(time.time()), "by": reason}))


def boot_id():
    """The kernel's boot id (changes on every reboot), or None without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def proc_fields(pid):
    """The fields of /proc/<pid>/stat after comm (state, ppid, pgrp, session, ...), or None if gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    return [f.decode() for f in data[data.rindex(b")") + 2 :].split()]


def proc_stat(pid):
    """(state letter, start time in clock ticks) from /proc/<pid>/stat, or None if gone."""
    fields = proc_fields(pid)
    return (fields[0], int(fields[19])) if fields else None


def marker(pid):
    """pid + kernel start time + boot id: equal markers mean the very same process."""
    stat = proc_stat(pid)
    return {"pid": pid, "start": stat[1] if stat else None, "boot": boot_id()}


def alive(mark):
    """True when the process named by a marker still runs (not a reused pid, not a zombie)."""
    if not mark:
        return False
    if mark.get("boot") and mark["boot"] != boot_id():
        return False
    stat = proc_stat(mark["pid"])
    if stat is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc (not Linux): best effort
            os.kill(mark["pid"], 0)
            return True
        except OSError:
            return False
    return stat[0] not in ("Z", "X") and (mark.get("start") is None or stat[1] == mark["start"])


def signal_group(pgid, sig):
    """Signal a process group, ignoring one that is already gone."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def signal_process(pid, sig):
    """Signal one process, ignoring one that is already gone."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass
