"""Benchmark `dflashctl push` against `rsync -a` over ssh, on a real sshd + the pct shim.

    python bench/push_bench.py [--repeats 5] [--files 200] [--mb 20]

Starts the test harness's sshd (tests/sshd.py) on 127.0.0.1, builds a payload of N files of
random bytes, and times three cases for each tool, interleaved so all see the same machine load:
first push into an empty directory, a no-op push, and a push after one file changed.

What a user runs is timed: `dflashctl push shim` as a new process each time (Python start-up,
imports, SSH connect and all), through `pct exec 200` (the shim), against `rsync -a --delete`
over OpenSSH into the container's directory (skipping pct: that favours rsync a little). The
in-process `payload.push` with a fresh Session (its own SSH connect, no interpreter start) is
the breakdown column. The CLI runs twice: with hosts.yaml's defaults (connection reuse on,
`persist: 60`: the background mux kept between calls, started by an untimed first call) and with
`persist: 0` (a full SSH handshake per call). `--persist N` adds a `persist: N` host.

Beside the median wall times it prints the median client CPU time of each tool (user + system
of the process and the children it waited for: rsync's ssh, not sshd nor the background mux)
and the machine's load average over each case (os.getloadavg), so that ratios measured on a busy
machine say how busy. `python -c pass` (the same interpreter and environment) is the floor of any
Python CLI, timed in the same rounds. Before timing, dflashctl's modules are byte-compiled (as pip does when it
installs), so that an environment with PYTHONDONTWRITEBYTECODE does not make every call compile.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from sshd import CLI, SHIM_VMID, SshdHost  # noqa: E402

from dflashctl.inventory import DEFAULT_PERSIST_S  # noqa: E402
from dflashctl.payload import push  # noqa: E402


def make_payload(root: Path, files: int, total_mb: int) -> list[Path]:
    """files random files (10 per directory) adding up to total_mb MB; returns their paths."""
    size = total_mb * 1_000_000 // files
    paths = []
    for i in range(files):
        path = root / f"pkg{i // 10:02d}" / f"mod{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def timed(action: Callable[[], object]) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds) of one call of action: this process's CPU and that of
    the children it waited for (the in-process push's threads; a CLI process; rsync and its ssh)."""
    before = _cpu()
    started = time.perf_counter()
    action()
    return time.perf_counter() - started, _cpu() - before


def _cpu() -> float:
    """User + system seconds of this process and its waited-for children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Bench:
    """The two tools, pointed at the same container."""

    def __init__(self, host: SshdHost, source: Path):
        self.host = host
        self.source = source
        self.container = host.container_dir(SHIM_VMID)
        self.push_workdir = self.container / "work"
        self.rsync_dest = self.container / "work-rsync" / "payload"
        key = host.home / ".ssh" / "id_ed25519"
        known = host.home / ".ssh" / "known_hosts"
        self.env = dict(host.env)
        self.ssh = (
            f"ssh -p {host.port} -i {key} -o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes "
            f"-o BatchMode=yes -o IdentitiesOnly=yes"
        )

    def push(self) -> None:
        """One in-process push to the shim with a fresh Session, so it pays its SSH connect."""
        with self.host.session() as session:
            push(session.target("shim"), self.source)

    def push_cli(self, host: str = "shim") -> None:
        """One `dflashctl push` through the CLI: a new process, so Python startup and imports count."""
        done = subprocess.run([*CLI, "push", host, "--source", str(self.source)], env=self.env, capture_output=True)
        assert done.returncode == 0, done.stderr

    def rsync(self) -> None:
        """Mirror the source into the container with `rsync -a --delete` over ssh."""
        dest = f"{self.host.user}@{self.host.address}:{self.rsync_dest}/"
        self.rsync_dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["rsync", "-a", "--delete", "-e", self.ssh, f"{self.source}/", dest], check=True)

    def clear(self, tool: str) -> None:
        """Delete that tool's destination (the push tools share the container's workdir), so its
        next push is a first one."""
        shutil.rmtree(self.rsync_dest if tool == "rsync" else self.push_workdir, ignore_errors=True)


def run(repeats: int, files: int, total_mb: int, persist: int) -> None:
    """Time every tool on each case, repeats times in rotating order, then print the report."""
    base = Path(tempfile.mkdtemp(prefix="push-bench-"))
    host = SshdHost(base / "sshd", "127.0.0.1").start()
    runtime = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))
    runtime.chmod(0o700)
    try:
        source = base / "payload"
        paths = make_payload(source, files, total_mb)
        bench = Bench(host, source)
        # `dflashctl push` with hosts.yaml's defaults (the entry names no `persist`), and with
        # connection reuse off (`persist: 0`, the test harness's own entries).
        default = {k: v for k, v in host.host_entry(SHIM_VMID).items() if k != "persist"}
        extra = {"d": default, **({"p": host.host_entry(SHIM_VMID, persist=persist)} if persist else {})}
        inventory = host.write_inventory(base / "hosts.yaml", extra)
        bench.env.update(DFLASHCTL_INVENTORY=str(inventory), XDG_RUNTIME_DIR=str(runtime))
        tools: dict[str, Callable[[], None]] = {
            f"dflashctl push (default: persist {DEFAULT_PERSIST_S})": lambda: bench.push_cli("d"),
            "rsync": bench.rsync,
            "dflashctl push, persist 0": bench.push_cli,
            "in-process": bench.push,
            # The floor of any Python CLI: the same interpreter and environment starting and exiting.
            "python -c pass": lambda: subprocess.run([sys.executable, "-c", "pass"], env=bench.env, check=True),
        }
        if persist:
            tools[f"push, persist {persist}"] = lambda: bench.push_cli("p")
        muxed = {name: fn for name, fn in tools.items() if "default" in name or name.startswith("push, persist")}
        times = {c: {t: [] for t in tools} for c in ("first", "no-op", "one file")}
        cpu = {c: {t: [] for t in tools} for c in times}
        load: dict[str, list[float]] = {c: [] for c in times}
        names = list(tools)
        for i in range(repeats):
            order = names[i % len(names) :] + names[: i % len(names)]  # none always goes first
            for case in times:
                load[case].append(os.getloadavg()[0])
                if case == "one file":
                    paths[i % len(paths)].write_bytes(os.urandom(paths[0].stat().st_size))
                for tool in order:
                    if case == "first" and tool != "python -c pass":
                        if i == 0 and tool in muxed:
                            muxed[tool]()  # start the mux, untimed (its first call pays the SSH connect)
                        bench.clear(tool)
                    os.sync()  # start each timing with no dirty pages left by the previous one
                    wall, used = timed(tools[tool])
                    times[case][tool].append(wall)
                    cpu[case][tool].append(used)
        report(times, cpu, load, repeats, files, total_mb)
    finally:
        subprocess.run([*CLI, "hosts", "disconnect", "--all"], env=bench.env, capture_output=True)
        host.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


def report(times: dict, cpu: dict, load: dict, repeats: int, files: int, total_mb: int) -> None:
    """Print the median times per case as markdown tables, each tool against rsync, with the load."""
    print(
        f"push vs rsync -a over ssh: {files} files, {total_mb} MB, median of {repeats} (paired: each round "
        f"runs every tool, in rotating order)"
    )
    print(
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}, load average (1 min) at the end "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min)"
    )
    print()
    tools = list(next(iter(times.values())))
    others = [t for t in tools if t != "rsync"]
    print(
        "| case | load (1 min) | "
        + " | ".join(f"{t} (s)" for t in tools)
        + " | "
        + " | ".join(f"{t} / rsync" for t in others)
        + " |"
    )
    print("|---" * (2 + len(tools) + len(others)) + "|")
    for case, by_tool in times.items():
        med = {t: statistics.median(v) for t, v in by_tool.items()}
        print(
            f"| {case} | {statistics.median(load[case]):.1f} | "
            + " | ".join(f"{med[t]:.3f}" for t in tools)
            + " | "
            + " | ".join(f"{med[t] / med['rsync']:.2f}" for t in others)
            + " |"
        )
    print()
    print("client CPU time, user + system (median, s):")
    print()
    print("| case | " + " | ".join(f"{t}" for t in tools) + " | " + " | ".join(f"{t} / rsync" for t in others) + " |")
    print("|---" * (1 + len(tools) + len(others)) + "|")
    for case, by_tool in cpu.items():
        med = {t: statistics.median(v) for t, v in by_tool.items()}
        print(
            f"| {case} | "
            + " | ".join(f"{med[t]:.3f}" for t in tools)
            + " | "
            + " | ".join(f"{med[t] / med['rsync']:.2f}" for t in others)
            + " |"
        )


def main() -> None:
    """Parse options and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=int, default=20)
    parser.add_argument("--persist", type=int, default=0, help="also time a persist: N host (0: not)")
    args = parser.parse_args()
    compileall.compile_dir(str(REPO / "dflashctl"), quiet=1)
    run(args.repeats, args.files, args.mb, args.persist)


if __name__ == "__main__":
    main()
