"""`runctl servers WORKDIR [stop]`: the fork servers this workdir's runs started (forking.py), and
stopping the idle ones.

A server is found by its command line (`python -m dflash_train.forkserver NAME ...`, this user's)
whose NAME has a log under `<workdir>/fork-server/`. One that has a trainer running (a child of
its own) is never stopped: that trainer's supervisor would lose its exit code.
"""

import os
import signal

from .common import emit, proc_stat, signal_process, utc_iso
from .forking import SERVER_MODULE

LOG_TAIL = 8192  # bytes of a server's log read for its state


def cmd_servers(workdir, stop="0"):
    """Every fork server of this workdir, and which were stopped (stop "1": those serving no trainer)."""
    logs = os.path.join(os.path.expanduser(workdir), "fork-server")
    names = {f[: -len(".log")] for f in _listdir(logs) if f.endswith(".log")}
    found = [dict(s, log=os.path.join(logs, s["name"] + ".log")) for s in _servers(names)]
    stopped = []
    for server in found:
        server["state"] = _state(server["log"], server["pid"])
        if stop == "1" and not server["trainers"]:
            signal_process(server["pid"], signal.SIGTERM)
            stopped.append(server["name"])
    emit({"servers": found, "stopped": stopped})


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _servers(names):
    """This user's server processes for `names`, each with its trainers (its live children)."""
    parents, found = {}, {}
    for entry in _listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        argv, stat = _cmdline(pid), _stat_fields(pid)
        if stat is None:
            continue
        if stat[0] not in ("Z", "X"):
            parents.setdefault(int(stat[1]), []).append(pid)
        if len(argv) > 3 and argv[1:3] == ["-m", SERVER_MODULE] and argv[3] in names and _owned(pid):
            found[pid] = ({"name": argv[3], "pid": pid, "idle_s": _option(argv, "--idle-s")}, int(stat[1]))
    # A forked trainer keeps its server's command line: a match whose parent matched is a trainer.
    servers = [server for server, ppid in found.values() if ppid not in found]
    for server in servers:
        server["trainers"] = sorted(parents.get(server["pid"], []))
        server["rss_mb"] = _rss_mb(server["pid"])
        start = proc_stat(server["pid"])
        server["started"] = _started(start[1]) if start else None
    return servers


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _stat_fields(pid):
    """(state, ppid) of a process, or None if gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # comm may hold spaces and parentheses
    return fields[0].decode(), fields[1].decode()


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
    """What the server's log last says of itself: importing, serving, refusing: WHY, or exiting."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log) - LOG_TAIL))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return "unknown (no log)"
    mine = "fork server %d: " % pid
    for line in reversed([line[len(mine) :] for line in lines if line.startswith(mine)]):
        if "; refusing: " in line:
            return "refusing: " + line.split("; refusing: ", 1)[1]
        for state in ("importing", "serving", "exiting"):
            if line.endswith(state):
                return state
        if line.startswith("cannot preload"):
            return line
    return "unknown"
