"""The two parts of a stop after the device-to-host copy (issue 31): writing the checkpoint's bytes
into the page cache, and the process's end, each by how it is done.

    python3 bench/stop_bench.py --gb 12.6 --device-gb 100 --out /tmp/stop-bench

write  --gb of host memory (pinned arenas, as the checkpoint writer's) written into the page cache
       as 1, 2, 4 and 8 files, one thread each, as a checkpoint's files are written
       (tensor_file.write_safetensors: os.write in 64 MiB pieces, no fsync): GB/s. The files are
       flushed, evicted from the page cache (checkpoint_flush.evict) and removed between cases.
exit   a fresh child process takes what the case names (a CUDA context, --device-gb of device memory,
       --gb of host memory pinned by torch's allocator in 256 MiB arenas, or by cudaHostRegister on
       an mmap with 4 KiB or transparent huge pages), touches it, prints the time and calls os._exit
       as the payload's `fast_exit` does; the parent times from that print to waitpid's return, and
       the child reports how long the pinning took.
Prints two tables; stop.json under --out. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote_payload"))

from dflash_train.checkpoint_flush import evict, fsync_path  # noqa: E402
from dflash_train.tensor_file import write_safetensors  # noqa: E402

ARENA = 2**28

CHILD = r"""
import mmap, os, sys, time, torch
device_gb, pinned_gb, how = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
torch.cuda.init(); torch.zeros(1, device="cuda")
held = [torch.ones(int(device_gb * 1e9) // 2, dtype=torch.bfloat16, device="cuda")] if device_gb else []
size = int(pinned_gb * 1e9) // 2**28 * 2**28
t0 = time.time()
if how == "torch":
    pinned = [torch.ones(2**28, dtype=torch.uint8, pin_memory=True) for _ in range(size // 2**28)]
elif how.startswith("register"):
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if how == "register-huge":
        area.madvise(mmap.MADV_HUGEPAGE)
    pinned = torch.frombuffer(area, dtype=torch.uint8)
    pinned.fill_(1)
    error = int(torch.cuda.cudart().cudaHostRegister(pinned.data_ptr(), size, 0))
    assert error == 0, f"cudaHostRegister: {error}"
torch.cuda.synchronize()
print(f"{time.time() - t0} {time.time()}", flush=True)
os._exit(0)
"""


def arenas(gb: float) -> list[torch.Tensor]:
    """gb of pinned host memory in 256 MiB arenas, filled."""
    return [
        torch.full((ARENA,), 7, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        for _ in range(int(gb * 1e9) // ARENA)
    ]


def write_rate(out: Path, memory: list[torch.Tensor], files: int) -> float:
    """GB/s writing `memory` as `files` safetensors files in as many threads, as a checkpoint's are
    written (tensor_file.write_safetensors); each file is then flushed, evicted and removed."""
    shares = [{str(i): a for i, a in enumerate(memory[k::files])} for k in range(files)]
    paths = [out / f"part{k}.safetensors" for k in range(files)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(write_safetensors, paths, shares))
    seconds = time.perf_counter() - t0
    for path in paths:
        fsync_path(path)
        evict(path)
        path.unlink()
    return sum(a.numel() for a in memory) / 1e9 / seconds


def exit_case(device_gb: float, pinned_gb: float, how: str) -> dict:
    """Run one exit case in a child: (seconds it took to pin, seconds from its last print to its reaped exit)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(device_gb), str(pinned_gb), how], stdout=subprocess.PIPE, text=True
    )
    line = child.stdout.readline()
    child.wait()
    reaped = time.time()
    if not line:  # the child failed before its exit: its error is on stderr
        return {"pin_s": None, "exit_s": None, "code": child.returncode}
    pin_s, said = (float(v) for v in line.split())
    return {"pin_s": round(pin_s, 2), "exit_s": round(reaped - said, 2), "code": child.returncode}


def main() -> int:
    """Time the writes and the exits; print the tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=12.6, help="the checkpoint's size (the 8B preset's: 12.6)")
    ap.add_argument("--device-gb", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/stop-bench"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'unknown'}")
    memory = arenas(args.gb)
    writes = [{"files": n, "gb_per_s": round(write_rate(args.out, memory, n), 2)} for n in (1, 2, 4, 8, 1)]
    del memory
    exits = [
        {"case": name, **exit_case(dev, pin, how)}
        for name, dev, pin, how in [
            ("CUDA context", 0.0, 0.0, "none"),
            (f"+ {args.device_gb:g} GB device memory", args.device_gb, 0.0, "none"),
            (f"+ {args.gb:g} GB pinned by torch (256 MiB arenas)", args.device_gb, args.gb, "torch"),
            (f"+ {args.gb:g} GB cudaHostRegister, 4 KiB pages", args.device_gb, args.gb, "register"),
            (f"+ {args.gb:g} GB cudaHostRegister, MADV_HUGEPAGE", args.device_gb, args.gb, "register-huge"),
        ]
    ]
    (args.out / "stop.json").write_text(json.dumps({"writes": writes, "exits": exits}, indent=1))
    print(f"| files (threads) | GB/s into the page cache ({args.gb:g} GB) |\n| ---: | ---: |")
    for w in writes:
        print(f"| {w['files']} | {w['gb_per_s']} |")
    print("| process holds | pinning (s) | exit (s) |\n| --- | ---: | ---: |")
    for e in exits:
        print(f"| {e['case']} | {e['pin_s']} | {e['exit_s']} |")
    return 0 if all(e["code"] == 0 for e in exits) else 1


if __name__ == "__main__":
    sys.exit(main())
