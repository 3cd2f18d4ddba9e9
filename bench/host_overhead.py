"""Host-side cost of one training step in the threaded trainer: one GPU, one worker thread.

    python bench/host_overhead.py --out DIR [--configs small,mid,8b] [--variants after,before] [--budget-s 540]
    python bench/host_overhead.py --dry-run --out DIR     # CPU, the tiny preset: tests the script

Rows: `small` and `mid` are bench/threads_vs_procs.py's configs under `run.compile: cudagraphs`
(`after`: run.capture_optimizer auto, clip + AdamW + zero grads replayed as one CUDA graph;
`before`: run.capture_optimizer off, the eager fused AdamW of earlier tables); `8b` is the
qwen3-8b preset as a user runs it (compile default, per-layer scope; `after`: run.capture_target
auto, the target's feature forward replayed as one CUDA graph; `before`: off, every layer launched
from Python; the optimizer stays eager in both). Every row is a subprocess with a timeout.

What each row measures, through `workers.run_threaded` on [cuda:0] (the trainer's loop, its
barrier and GlobalBatches included) with timing wrappers around the replica ops:

- ms/step: wall time per step, free-running as in training (no host sync per step), over the
  sync windows after the first one of the free-running phase.
- host ms/step: the time the worker thread is busy per step when it never waits for the GPU.
  Before each of the first --host-steps steps the wrapper synchronises the device (outside the
  timing: the GPU is idle), then times from fetching the batch to the return of the optimizer
  step: batch copy, guard checks and graph replays, autograd's call into the compiled backward,
  the barrier, the optimizer step, the scheduler. Nothing in that window syncs with the GPU and
  one step's launches do not fill the launch queue, so the window is the thread's own work
  (Python and launch calls, both holding the GIL). Median over those steps. Not included: the
  per-step loss accumulation (one kernel) and the periodic sync-point work. The window runs under
  `torch.cuda.set_sync_debug_mode("warn")`: the `syncs` column counts the synchronising calls seen
  there (any makes that row's host figure include GPU time). A step of more kernels than the launch
  queue holds also waits for the GPU inside the window, which no counter shows.
- predicted N_max ~= device ms/step / host ms/step: threads share one GIL, so N threads need
  N x host ms of the GIL per step; they keep up while that fits in the GPU's step time. The
  device time is the free-running ms/step when it exceeds the host time (the GPU is then the
  bottleneck); when it does not, one GPU already waits for the host: N_max 1. The all-reduce's
  launch cost for N > 1 is not in it.

Prints the table last; writes host_overhead.json and host_overhead.log under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_payload"))
sys.path.insert(0, str(ROOT / "bench"))

SYNC_EVERY = 10
PER_GPU_BATCH = 2  # small and mid, as bench/threads_vs_procs.py
ROWS = {  # config -> (host-timed steps, free-running steps, timeout s)
    "small": (40, 200, 240),
    "mid": (20, 60, 300),
    "8b": (10, 20, 420),
    "tiny": (10, 40, 240),
}


def overrides(config: str, variant: str, device: str) -> tuple[str | None, list[str]]:
    """(preset, --set overrides) of one row."""
    captures = [
        f"run.capture_optimizer={'auto' if variant == 'after' else 'off'}",
        f"run.capture_target={'auto' if variant == 'after' else 'off'}",
    ]
    common = [f"run.device={device}", *captures, "run.spec_prompts=0"]
    if config == "8b":
        return "qwen3-8b", common + ["data.num_train=32"]
    if config == "tiny":  # --dry-run: the CPU default
        return None, common + ["data.source=random", "data.num_train=64", "data.num_eval=4"]
    from threads_vs_procs import CONFIGS

    return None, CONFIGS[config] + common + [
        "data.source=random",
        f"data.batch_size={PER_GPU_BATCH}",
        "data.num_train=512",
        "data.num_eval=4",
        "run.dtype=bf16",
        "run.compile=cudagraphs",
    ]


def child(args) -> dict:
    """One row: run_threaded on one device with timing wrappers; returns the measurements."""
    import torch

    from dflash_train import workers as W
    from dflash_train.config import load_config
    from dflash_train.data import BlockSampler, build_datasets
    from dflash_train.replica import drafter_ops
    from dflash_train.plan import resolve_run
    from dflash_train.train import GlobalBatches

    host_steps, run_steps, _ = ROWS[args.config]
    device = "cpu" if args.dry_run else "cuda:0"
    preset, over = overrides(args.config, args.variant, device)
    plan = resolve_run(load_config(preset=preset, overrides=over + [f"run.steps={host_steps + run_steps}"]))
    cfg = plan.cfg
    torch.set_num_threads(cfg.run.cpu_threads)  # as the trainer
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    batches = GlobalBatches(
        BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed), pin=device.startswith("cuda")
    )
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    ops = drafter_ops(cfg)
    started: dict[str, float] = {}
    host_ms: list[float] = []
    syncs: list[str] = []
    shown = warnings.showwarning

    def count_syncs(message, category, *rest, **kw):
        if "t" in started and "called a synchronizing" in str(message):
            # Where: the innermost caller outside this file and the warnings machinery.
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
            syncs.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1]))
        elif "prototype feature" not in str(message):
            shown(message, category, *rest, **kw)

    warnings.showwarning = count_syncs
    warnings.simplefilter("always")  # every synchronising call in a host window, not the first of each
    debug = device.startswith("cuda")

    def data(step, rank, world):
        if step < host_steps:
            sync()  # the GPU is idle: nothing below waits for it
            started["t"] = time.perf_counter()
            if debug:
                torch.cuda.set_sync_debug_mode("warn")
        return batches(step, rank, world)

    def optimizer_step(replica, keep_grads):
        out = ops.optimizer_step(replica, keep_grads)
        if "t" in started:
            host_ms.append((time.perf_counter() - started["t"]) * 1e3)
            if debug:
                torch.cuda.set_sync_debug_mode("default")
            del started["t"]  # the window closes: syncs after this are not counted
        return out

    windows = []

    def on_sync(point):
        windows.append((point.step, point.steps_since_last, point.seconds_since_last))
        return False

    opts = W.ThreadedOptions(
        policy=plan.policy,
        seed=cfg.run.seed,
        warmup_steps=plan.warmup_steps,
        sync_at=W.every(SYNC_EVERY),
        barrier_timeout_s=600,
        compile_timeout_s=600,
    )
    res = W.run_threaded(
        dataclasses.replace(ops, optimizer_step=optimizer_step), [device], data, cfg.run.steps, opts, on_sync
    )
    host_ms = host_ms[1:]  # step 1 pays one-off costs (allocator growth, the first scheduler step)
    free = [(n, s) for step, n, s in windows if step > host_steps + SYNC_EVERY]
    ms = sum(s for _, s in free) / sum(n for n, _ in free) * 1e3
    host = statistics.median(host_ms)
    replica = res.replicas[0]
    return {
        "config": args.config,
        "variant": args.variant,
        "ms_per_step": ms,
        "host_ms_per_step": host,
        "host_ms_mean": statistics.mean(host_ms),
        "host_ms_min": min(host_ms),
        "host_steps": len(host_ms),
        "free_steps": sum(n for n, _ in free),
        "warmup_s": res.warmup_s[0],
        "policy": res.policy.reason,
        "compile": cfg.run.compile,
        "scope": cfg.run.compile_scope,
        "captured_optimizer": replica.step_graph is not None,
        "captured_target": replica.target_graph is not None,
        "final_loss": res.losses[0],
        "checksum": res.checksums[0],
        "n_max": n_max(ms, host),
        "syncs": len(syncs),
        "sync_calls": sorted(set(syncs))[:8],
    }


def n_max(device_ms: float, host_ms: float) -> int:
    """Largest GPU count whose threads' host work (N x host ms, one GIL) fits in a GPU step."""
    return max(1, math.floor(device_ms / host_ms))


def run_row(config: str, variant: str, args, log) -> dict:
    """One row in a subprocess with a timeout; its result or why there is none."""
    argv = [sys.executable, __file__, "--child", "--config", config, "--variant", variant]
    argv += ["--dry-run"] if args.dry_run else []
    timeout = ROWS[config][2]
    t0 = time.monotonic()
    from threads_vs_procs import launch

    status, lines = launch(argv, timeout, log, dict(os.environ, PYTHONUNBUFFERED="1"))
    status = f"timed out after {timeout} s" if status.startswith("HANG") else status
    found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    row = found[0] if found else {"config": config, "variant": variant}
    row.update(status=status if found or status != "ok" else "no result", wall_s=round(time.monotonic() - t0, 1))
    return row


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, with the prediction per row."""
    lines = [
        "| config | variant | compile | captured graphs | ms/step | host ms/step (median; min) | "
        "syncs in host windows | predicted N_max | warm-up s | final loss | status |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "ms_per_step" not in r:
            lines.append(f"| {r['config']} | {r['variant']} | - | - | - | - | - | - | - | - | {r['status']} |")
            continue
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['compile']} ({r['scope']}) | "
            f"{captured(r)} | {r['ms_per_step']:.2f} | "
            f"{r['host_ms_per_step']:.2f}; {r['host_ms_min']:.2f} | {r['syncs']} | {r['n_max']} | "
            f"{r['warmup_s']:.1f} | "
            f"{r['final_loss']:.4f} | {r['status']} |"
        )
    return "\n".join(lines)


def captured(row: dict) -> str:
    """Which parts of the row's step replayed as captured CUDA graphs besides the compiled ones."""
    parts = [name for name, key in (("optimizer", "captured_optimizer"), ("target", "captured_target")) if row.get(key)]
    return ", ".join(parts) or "none"


def predictions(rows: list[dict]) -> list[str]:
    """One line per config: the N_max of its `after` row (the current code)."""
    out = []
    for r in rows:
        if r.get("variant") == "after" and "n_max" in r:
            out.append(
                f"{r['config']}: threads keep up with the GPU up to about {r['n_max']} GPU(s) "
                f"({r['ms_per_step']:.2f} ms/step on the device / {r['host_ms_per_step']:.2f} ms/step of host work)"
            )
    return out


def main(argv=None) -> int:
    """Run the rows within the budget; print the table and the predicted GPU counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="small,mid,8b")
    p.add_argument("--variants", default="after,before")
    p.add_argument("--budget-s", type=float, default=540, help="start no row after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, the tiny preset, compile off")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    configs = ["tiny"] if args.dry_run else args.configs.split(",")
    variants = args.variants.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = []
    with (out / "host_overhead.log").open("w") as log:
        for config in configs:
            for variant in variants:
                if time.monotonic() - t0 > args.budget_s:
                    rows.append({"config": config, "variant": variant, "status": "skipped (budget)"})
                    continue
                rows.append(run_row(config, variant, args, log))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    (out / "host_overhead.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    for r in rows:
        for where in r.get("sync_calls", []):
            print(f"sync in a host window ({r['config']} {r['variant']}): {where}")
    print(
        "\n".join(
            [
                "",
                "predicted largest GPU count at which threads keep up (GIL-bound; N_max ~= device "
                "ms/step / host ms/step):",
            ]
            + predictions(rows)
        )
    )
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
