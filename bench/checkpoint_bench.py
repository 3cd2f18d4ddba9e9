"""How long a checkpoint stops training, and how long its write takes (issue 31), on a synthetic state.

    python3 bench/checkpoint_bench.py --gb 3 --out /tmp/ckpt-bench [--device cuda] [--repeat 3]

The state: fp32 weights and the AdamW state of one step (a third and two thirds of --gb), as the
8B preset's 12.6 GB are. For each repeat it times, into --out:
  sync   the synchronous save the trainer did before issue 31 (weights copied with .cpu(), then
         safetensors and torch.save one after the other, torch.save computing its CRC32)
  async  `CheckpointWriter.save` (the copy to host memory: what the step loop waits for) and then
         its background write (all of the checkpoint's files at once, one thread each), flushed to
         the disk as a periodic checkpoint is, then a stop's (not flushed in its wait)
and prints the median of each. The sync save's files go to the page cache (no fsync).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote_payload"))

from dflash_train.checkpoint_writer import CheckpointWriter  # noqa: E402


def synthetic_state(gb: float, device: torch.device):
    """Weights of gb/3 GB in 16 tensors, AdamW after one step, and a LambdaLR."""
    per_tensor = int(gb * 1e9 / 3 / 4 / 16)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per_tensor, device=device)) for _ in range(16)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def sync_save(out: Path, model, optimizer, scheduler) -> float:
    """The pre-issue-31 save's file writes, timed."""
    t0 = time.perf_counter()
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(out / "w.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, out / "o.pt")
    return time.perf_counter() - t0


def main() -> int:
    """Time the synchronous and the asynchronous checkpoint of a synthetic state."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=3.0, help="size of the state (weights + AdamW), GB")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ckpt-bench"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, optimizer, scheduler = synthetic_state(args.gb, device)
    lines: list[str] = []
    writer = CheckpointWriter(args.out / "async", keep=1, log=lines.append)
    times: dict[str, list[float]] = {"sync save": [], "async blocked": [], "async write": [], "a stop's write": []}
    for _ in range(args.repeat):
        shutil.rmtree(args.out, ignore_errors=True)
        (args.out / "sync").mkdir(parents=True)
        times["sync save"].append(sync_save(args.out / "sync", model, optimizer, scheduler))
        shutil.rmtree(args.out / "sync")
        t0 = time.perf_counter()
        writer.save(1, model, optimizer, scheduler, {}, device)
        t1 = time.perf_counter()
        writer.wait()
        times["async blocked"].append(t1 - t0)
        times["async write"].append(float(lines[-1].split("written in ")[1].split(" s")[0]))
        writer.save(2, model, optimizer, scheduler, {}, device, durable=False)
        writer.wait()
        times["a stop's write"].append(float(lines[-1].split("written in ")[1].split(" s")[0]))
    for label, values in times.items():
        print(f"{label:14s} median {statistics.median(values):6.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"state: {writer.buffers.nbytes / 1e9:.2f} GB; the first async copy allocated its host buffers")
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
