"""`runctl servers WORKDIR [stop]`: the fork servers this workdir's runs started (forking.py), and
stopping them.

A server is found by its command line (`python -m dflash_train.forkserver NAME ...`, this user's)
whose NAME has a log under `<workdir>/fork-server/`. A forked trainer keeps that command line too;
it leads a session of its own (the server's child calls setsid), which a server never does (the
go-between that started it does). A stop is SIGTERM: the server stops serving at once and exits
once the trainers it forked have ended, so their supervisors still get their exit codes.
"""

import os
import signal

from .common import emit, proc_fields, signal_process, utc_iso
from .forking import SERVER_MODULE


def cmd_servers(workdir, stop="0"):
    """Every fork server of this workdir; stop "1": SIGTERM to each (the pids in `stopped`)."""
    logs = os.path.join(os.path.expanduser(workdir), "fork-server")
    names = {f[: -len(".log")] for f in _listdir(logs) if f.endswith(".log")}
    found = [dict(s, log=os.path.join(logs, s["name"] + ".log")) for s in (_servers(names) if names else [])]
    for server in found:
        server["state"] = _state(server["log"], server["pid"])
        if stop == "1":
            signal_process(server["pid"], signal.SIGTERM)
    emit({"servers": found, "stopped": [s["pid"] for s in found] if stop == "1" else []})


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _servers(names):
    """This user's server processes for `names`, each with its trainers (its children that run)."""
    trainers, servers = {}, []
    for entry in _listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = proc_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            continue
        leads_session = int(fields[3]) == pid
        if leads_session:  # a forked trainer (the server's self-check children are not)
            trainers.setdefault(int(fields[1]), []).append(pid)
            continue
        argv = _cmdline(pid)
        if len(argv) > 3 and argv[1:3] == ["-m", SERVER_MODULE] and argv[3] in names and _owned(pid):
            idle = _option(argv, "--idle-s")
            servers.append({"name": argv[3], "pid": pid, "idle_s": float(idle) if idle else None, "ticks": fields[19]})
    for server in servers:
        server["trainers"] = sorted(trainers.get(server["pid"], []))
        server["rss_mb"] = _rss_mb(server["pid"])
        server["started"] = _started(int(server.pop("ticks")))
    return servers


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _owned(pid):
    try:
        return os.stat("/proc/%d" % pid).st_uid == os.getuid()
    except OSError:
        return False


def _option(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _rss_mb(pid):
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024)
    except (OSError, ValueError):
        pass
    return None


def _started(ticks):
    """A process's start time (clock ticks after boot) as an ISO time."""
    try:
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return utc_iso(boot + ticks / os.sysconf("SC_CLK_TCK"))


def _state(log, pid):
    """What the server's log last says of itself: importing, serving, refusing: WHY, no longer
    serving: WHY (its trainers still run), exiting, or unknown."""
    try:
        with open(log, "rb") as fh:
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return "unknown"
    mine = "fork server %d: " % pid
    for line in reversed([line[len(mine) :] for line in lines if line.startswith(mine)]):
        for prefix in ("no longer serving: ", "refusing: "):
            if line.startswith(prefix) or "; " + prefix in line:
                return prefix + line.split(prefix, 1)[1]
        for state in ("importing", "serving", "exiting"):
            if line.endswith(state):
                return state
    return "unknown"
