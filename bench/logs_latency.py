"""Log-follow latency: time from a line appended to train.log to that line reaching the client.

Starts a real sshd with the pct shim (tests/sshd.py), fakes a running run in the container, and
follows it with `dflashctl.logs.read_log` while this process appends lines stamped with
`time.monotonic()` (same machine, same clock) at random gaps. Also runs the same on `local`.
Goal: p99 < 0.5 s. Usage: python bench/logs_latency.py [--lines 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from runs_helpers import local_session  # noqa: E402
from sshd import SHIM_VMID, SshdHost  # noqa: E402

from dflashctl.logs import Reconnect, read_log  # noqa: E402
from dflashctl.remote.runctl import marker  # noqa: E402

RUN_ID = "20261130-000000-bench"


def fake_run(workdir: Path) -> tuple[Path, subprocess.Popen]:
    """A run directory that counts as running while a sleep process lives."""
    rdir = workdir / "runs" / RUN_ID
    rdir.mkdir(parents=True)
    keeper = subprocess.Popen(["sleep", "3600"])
    (rdir / "run.json").write_text(json.dumps({"run_id": RUN_ID, "started_ts": 0, "supervisor": marker(keeper.pid)}))
    (rdir / "train.log").write_bytes(b"")
    return rdir, keeper


def measure(session, host: str | None, workdir: Path, lines: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Latencies in seconds of `lines` lines written at random 0-100 ms gaps."""
    rdir, keeper = fake_run(workdir)
    latencies: list[float] = []
    partial = bytearray()
    started = threading.Event()

    def on_data(data: bytes) -> None:
        now = time.monotonic()
        started.set()
        partial.extend(data)
        *done, rest = bytes(partial).split(b"\n")
        partial[:] = rest
        latencies.extend(now - float(line.split()[1]) for line in done if line.startswith(b"t "))

    reader = threading.Thread(
        target=read_log,
        args=(session, host, RUN_ID),
        daemon=True,
        kwargs=dict(on_data=on_data, follow=True, lines=-1, policy=Reconnect()),
    )
    reader.start()
    with open(rdir / "train.log", "ab", buffering=0) as log:
        log.write(b"hello\n")
        started.wait(30)
        for _ in range(lines):
            time.sleep(random.uniform(0, 0.1))
            log.write(b"t %.6f\n" % time.monotonic())
    time.sleep(1)
    (rdir / "exit_code").write_text("0\n")
    keeper.kill()
    keeper.wait()
    reader.join(30)
    return latencies


def report(name: str, lat: list[float]) -> str:
    """One markdown table row: line count, then p50, p90, p99 and max latency in ms."""
    ms = sorted(x * 1000 for x in lat)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return f"| {name} | {len(ms)} | {statistics.median(ms):.0f} | {pick(0.9):.0f} | {pick(0.99):.0f} | {ms[-1]:.0f} |"


def main() -> None:
    """Measure follow latency locally and through sshd + the pct shim; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        local_dir = Path(tmp) / "local"
        with local_session(local_dir) as session:
            rows.append(report("local", measure(session, None, local_dir, args.lines)))
        host = SshdHost(Path(tmp) / "sshd", "127.0.0.1").start()
        try:
            with host.session() as session:
                workdir = host.container_dir(SHIM_VMID) / "work"
                rows.append(report("sshd + pct shim", measure(session, "shim", workdir, args.lines)))
        finally:
            host.stop()
    print(
        f"{time.strftime('%Y-%m-%d')} {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )
    print("| path | lines | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
