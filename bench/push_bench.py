"""Benchmark `dflashctl push` against `rsync -a` over ssh, on a real sshd + the pct shim.

    python bench/push_bench.py [--repeats 5] [--files 200] [--mb 20]

Starts the test harness's sshd (tests/sshd.py) on 127.0.0.1, builds a payload of N files of
random bytes, and times three cases for each tool, interleaved so both see the same machine load:
first push into an empty directory, a no-op push, and a push after one file changed.

`push` runs in-process with a fresh Session per push (so every push pays its SSH connect, as an
rsync call pays ssh's), through `pct exec 200` (the shim). rsync writes straight into the
container's directory over ssh, skipping pct: that favours rsync a little. The table also shows
one no-op `dflashctl push` CLI call, whose extra cost is Python startup plus imports.
"""

from __future__ import annotations

import argparse
import os
import platform
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


def timed(action: Callable[[], object]) -> float:
    """Wall-clock seconds one call of action takes."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


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
        self.ssh = (
            f"ssh -p {host.port} -i {key} -o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes "
            f"-o BatchMode=yes -o IdentitiesOnly=yes"
        )

    def push(self) -> None:
        """One in-process push to the shim with a fresh Session, so it pays its SSH connect."""
        with self.host.session() as session:
            push(session.target("shim"), self.source)

    def push_cli(self) -> None:
        """One `dflashctl push` through the CLI: a new process, so Python startup and imports count."""
        done = subprocess.run([*CLI, "push", "shim", "--source", str(self.source)], env=self.host.env, capture_output=True)
        assert done.returncode == 0, done.stderr

    def rsync(self) -> None:
        """Mirror the source into the container with `rsync -a --delete` over ssh."""
        dest = f"{self.host.user}@{self.host.address}:{self.rsync_dest}/"
        self.rsync_dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["rsync", "-a", "--delete", "-e", self.ssh, f"{self.source}/", dest], check=True)

    def clear(self) -> None:
        """Delete both destinations, so the next round starts with a first push."""
        shutil.rmtree(self.push_workdir, ignore_errors=True)
        shutil.rmtree(self.rsync_dest, ignore_errors=True)


def run(repeats: int, files: int, total_mb: int) -> None:
    """Time push and rsync on each case, repeats times in alternating order, then print the report."""
    base = Path(tempfile.mkdtemp(prefix="push-bench-"))
    host = SshdHost(base / "sshd", "127.0.0.1").start()
    try:
        source = base / "payload"
        paths = make_payload(source, files, total_mb)
        bench = Bench(host, source)
        times: dict[str, dict[str, list[float]]] = {c: {"push": [], "rsync": []} for c in ("first", "no-op", "one file")}
        cli_noop = []
        tools = {"push": bench.push, "rsync": bench.rsync}
        for i in range(repeats):
            order = ["push", "rsync"] if i % 2 == 0 else ["rsync", "push"]  # neither always goes first
            bench.clear()
            for case in times:
                if case == "one file":
                    paths[i % len(paths)].write_bytes(os.urandom(paths[0].stat().st_size))
                for tool in order:
                    os.sync()  # start each timing with no dirty pages left by the previous one
                    times[case][tool].append(timed(tools[tool]))
            cli_noop.append(timed(bench.push_cli))
        report(times, statistics.median(cli_noop), repeats, files, total_mb)
    finally:
        host.stop()
        shutil.rmtree(base, ignore_errors=True)


def report(times: dict, cli_noop: float, repeats: int, files: int, total_mb: int) -> None:
    """Print the median times per case as a markdown table, plus the CLI no-op time."""
    print(f"push vs rsync -a over ssh: {files} files, {total_mb} MB, median of {repeats}")
    print(f"{os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()} {platform.release()}")
    print()
    print(f"| case     | push (s) | rsync (s) | push / rsync |")
    print(f"|----------|---------:|----------:|-------------:|")
    for case, by_tool in times.items():
        ours, theirs = statistics.median(by_tool["push"]), statistics.median(by_tool["rsync"])
        print(f"| {case:<8} | {ours:8.3f} | {theirs:9.3f} | {ours / theirs:12.2f} |")
    print()
    print(f"no-op through the CLI (`dflashctl push`, new process): {cli_noop:.3f} s")


def main() -> None:
    """Parse options and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=int, default=20)
    args = parser.parse_args()
    run(args.repeats, args.files, args.mb)


if __name__ == "__main__":
    main()
