"""How long a CUDA process takes to end once it calls os._exit (issue 31: the part of a stop after the
trainer's last log line), by what it holds.

    python3 bench/exit_bench.py --device-gb 100 --pinned-gb 12.6 --out /tmp/exit-bench

Each case is a fresh child process that takes what the case names (a CUDA context, device memory
from the caching allocator, host memory pinned in 256 MiB arenas as the checkpoint writer's
buffers are), touches it, then prints the time and calls os._exit as the payload's `fast_exit`
does; the parent times from that print to waitpid's return. `freed first`: the pinned memory is
released (and the time that takes printed) before the exit. Prints a table; exit.json under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import os, sys, time, torch
device_gb, pinned_gb, free_first = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
torch.cuda.init(); torch.zeros(1, device="cuda")
held = [torch.ones(int(device_gb * 1e9) // 2, dtype=torch.bfloat16, device="cuda")] if device_gb else []
arena = 2**28
pinned = [torch.ones(arena, dtype=torch.uint8, pin_memory=True) for _ in range(int(pinned_gb * 1e9) // arena)]
torch.cuda.synchronize()
freed_s = 0.0
if free_first:
    empty = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache  # torch 2.13 / 2.11
    t0 = time.time(); pinned.clear(); empty(); freed_s = time.time() - t0
print(f"{freed_s} {time.time()}", flush=True)
os._exit(0)
"""


def one(device_gb: float, pinned_gb: float, free_first: bool) -> dict:
    """Run one case; the seconds from the child's last print to its reaped exit."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(device_gb), str(pinned_gb), "1" if free_first else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    child.wait()
    reaped = time.time()
    if not line:  # the child failed before its exit: its error is on stderr
        return {"exit_s": None, "freed_s": None, "code": child.returncode}
    freed_s, said = (float(v) for v in line.split())
    return {"exit_s": round(reaped - said, 2), "freed_s": round(freed_s, 2), "code": child.returncode}


def main() -> int:
    """Time the exits and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-gb", type=float, default=100.0)
    ap.add_argument("--pinned-gb", type=float, default=12.6)
    ap.add_argument("--out", type=Path, default=Path("/tmp/exit-bench"))
    args = ap.parse_args()
    cases = [
        ("CUDA context", 0.0, 0.0, False),
        (f"+ {args.device_gb:g} GB device memory", args.device_gb, 0.0, False),
        (f"+ {args.pinned_gb:g} GB pinned host memory", args.device_gb, args.pinned_gb, False),
        ("the same, pinned memory freed first", args.device_gb, args.pinned_gb, True),
    ]
    rows = [{"case": name, **one(dev, pin, free)} for name, dev, pin, free in cases]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exit.json").write_text(json.dumps(rows, indent=1))
    print("| process holds | exit (s) | freeing the pinned memory first (s) |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['exit_s']} | {r['freed_s'] or '-'} |")
    return 0 if all(r["code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
