"""Where the trainer's start-up goes, phase by phase, at the `qwen3-8b` preset on one GPU: torch
import, CUDA context, the compiler's import, config and data, target, drafter (draw, copy to the
GPU), optimizer, and a whole `build_replica`. Prints one JSON line; docs/performance.md.

    python3 bench/startup_profile.py [--preset qwen3-8b] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_payload"))


def main() -> int:
    """Time each start-up phase once, in the order the trainer runs them."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    times: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        times[name] = round(now - mark[0], 2)
        mark[0] = now

    import torch

    lap("import torch")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    sync()
    lap("CUDA context")
    import torch._dynamo  # noqa: F401 - what the first torch.compile call imports
    import torch._inductor.compile_fx  # noqa: F401

    lap("import dynamo + inductor")
    from dflash_train.config import load_config
    from dflash_train.model import DFlashDrafter
    from dflash_train.plan import resolve_run
    from dflash_train.resolve import drafter_spec
    from dflash_train.replica import build_replica, build_target
    from dflash_train.train import load_data

    plan = resolve_run(load_config(preset=args.preset, overrides=[f"run.device={args.device}"]))
    cfg = plan.cfg
    lap("config")
    load_data(cfg)
    lap("data")
    target = build_target(cfg, device)
    sync()
    lap("target (random, on the GPU)")
    del target
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.to_empty(device="cpu")
    lap("drafter allocate (CPU)")
    drafter.init_weights(cfg.drafter.init_std, 0)
    lap("drafter draw (CPU threads)")
    drafter.to(device)
    sync()
    lap("drafter to GPU")
    torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    lap("optimizer")
    del drafter
    if cuda:
        torch.cuda.empty_cache()
    lap("free")
    replica = build_replica(cfg, device, 0, plan.policy)
    sync()
    lap("build_replica, all of it")
    del replica
    times["total"] = round(time.perf_counter() - T0, 2)
    print(
        json.dumps(
            {
                "preset": args.preset,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "torch": torch.__version__,
                "seconds": times,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
