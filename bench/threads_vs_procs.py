"""Threads vs one process per GPU for the DFlash drafter training step (run on a multi-GPU machine).

    python bench/threads_vs_procs.py --out DIR [--budget-s 540] [--repeats 3] [--configs small,mid]

Every run is a subprocess with a timeout (a hang or crash is a result, not the end of the bench).
Variants: 1 thread on 1 GPU (cudagraphs: the scaling baseline); threads on every GPU x
{off, default, cudagraphs}; one process per GPU x {cudagraphs} (torch.distributed NCCL). All use
workers.py's compile policy and gradient averaging math, so only threads vs processes differs.
Prints a table last; writes bench.json and bench.log under --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_payload"))

PER_GPU_BATCH = 2
SYNC_EVERY = 10  # checksum + host sync cadence; also the timing windows of the steady-state figure
CONFIGS = {
    # launch-bound: a tiny drafter whose step is mostly kernel launches and Python
    "small": [
        "target.hidden_size=256",
        "target.intermediate_size=768",
        "target.num_heads=4",
        "target.num_kv_heads=2",
        "target.head_dim=64",
        "target.num_layers=6",
        "target.vocab_size=4096",
        "drafter.num_layers=2",
        "drafter.block_size=16",
        "data.max_length=256",
        "data.anchors_per_seq=16",
    ],
    # mid-size: hidden 2048, 5 draft layers, seq 1024, 128 anchors, block 16; target cut at 6 layers
    "mid": [
        "target.hidden_size=2048",
        "target.intermediate_size=6144",
        "target.num_heads=16",
        "target.num_kv_heads=8",
        "target.head_dim=128",
        "target.num_layers=8",
        "target.vocab_size=32768",
        "drafter.num_layers=5",
        "drafter.block_size=16",
        "data.max_length=1024",
        "data.anchors_per_seq=128",
    ],
}
STEPS = {"small": 50, "mid": 30}
TIMEOUT_S = {"small": 180, "mid": 300}


def make_config(name: str, world: int, compile_mode: str, device: str, steps: int = 0):
    """The bench config's run plan: random data, bf16 on CUDA, PER_GPU_BATCH sequences per device."""
    from dflash_train.config import load_config
    from dflash_train.plan import resolve_run

    over = CONFIGS[name] + [
        "data.source=random",
        f"data.batch_size={PER_GPU_BATCH * world}",
        "data.num_train=512",
        "data.num_eval=4",
        f"run.device={device}",
        f"run.dtype={'bf16' if device == 'cuda' else 'fp32'}",
        f"run.compile='{compile_mode}'",
        f"run.steps={steps or STEPS[name]}",
    ]
    plan = resolve_run(load_config(overrides=over))
    cfg = plan.cfg
    import torch

    # As train.py does: several Python threads each running OpenMP-parallel CPU ops would
    # oversubscribe the cores (the trainer's default is one intra-op thread).
    torch.set_num_threads(cfg.run.cpu_threads)
    return plan


def sampler_for(cfg):
    """The trainer's BlockSampler over cfg's training set."""
    from dflash_train.data import BlockSampler, build_datasets

    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    return BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)


def steady_ms(windows: list[tuple[int, float]]) -> float | None:
    """ms/step over every (steps, seconds) window but the first: one-off costs of the first steps
    (optimizer state, allocator growth) stay out of the steady-state figure."""
    rest = windows[1:]
    return sum(s for _, s in rest) / sum(n for n, _ in rest) * 1e3 if rest else None


def eval_loss(replica, batch) -> float:
    """Loss of the eager drafter on one fixed batch: equal across GPUs iff replicas are equal."""
    import torch
    from dflash_train.replica import forward_loss

    with torch.no_grad():
        return float(forward_loss(replica, batch).loss)


def child_threads(args) -> dict:
    """Threads: workers.run_threaded over GPUs 0..world-1, fed like the trainer (GlobalBatches)."""
    from dflash_train import workers as W
    from dflash_train.replica import drafter_ops
    from dflash_train.train import GlobalBatches

    plan = make_config(args.config, args.world, args.compile, args.device, args.steps)
    cfg = plan.cfg
    sampler = sampler_for(cfg)
    opts = W.ThreadedOptions(policy=plan.policy, seed=cfg.run.seed, sync_at=W.every(SYNC_EVERY), barrier_timeout_s=240)
    windows: list[tuple[int, float]] = []

    def on_sync(point) -> bool:
        windows.append((point.steps_since_last, point.seconds_since_last))
        return False

    devices = [f"cuda:{i}" if args.device == "cuda" else "cpu" for i in range(args.world)]
    t0 = time.monotonic()
    res = W.run_threaded(
        drafter_ops(cfg),
        devices,
        GlobalBatches(sampler, pin=args.device == "cuda" and args.pin),
        cfg.run.steps,
        opts,
        on_sync,
    )
    batch = W.shard_batch(sampler.batch(0), 0, args.world)
    return {
        "warmup_s": res.warmup_s,
        "step_ms": res.step_ms,
        "steady_ms": steady_ms(windows),
        "checksums": res.checksums,
        "train_losses": res.losses,
        "eval_losses": [eval_loss(r, batch) for r in res.replicas],
        "wall_s": time.monotonic() - t0,
        "policy": res.policy.reason,
    }


def child_process(args) -> dict:
    """One rank of one-process-per-GPU: same replica, policy and averaging, NCCL via torch.distributed."""
    import torch
    import torch.distributed as dist
    from dflash_train import workers as W
    from dflash_train.grad_buckets import GradBuckets
    from dflash_train.replica import drafter_ops

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # the CPU dry run of this script
        dist.init_process_group("gloo")
    plan = make_config(args.config, world, args.compile, args.device, args.steps)
    cfg = plan.cfg
    sampler = sampler_for(cfg)

    def data(step: int) -> object:  # this rank's slice, pinned like the trainer's batches
        batch = W.shard_batch(sampler.batch(step), rank, world)
        return batch.pinned() if on_cuda and args.pin else batch

    ops = drafter_ops(cfg)
    policy = plan.policy
    torch.manual_seed(cfg.run.seed)
    replica = ops.build(device, cfg.run.seed, policy)
    params = ops.parameters(replica)
    flats = GradBuckets(params).attach()  # as the threads do: backward accumulates into flat buffers
    t0 = time.monotonic()
    for _ in range(2):
        ops.forward_backward(replica, data(0))
    sync(device)
    for flat in flats:
        flat.zero_()
    ops.warm_up_step(replica)  # as the workers do: capture the optimizer step (run.capture_optimizer)
    sync(device)
    warmup = time.monotonic() - t0
    dist.barrier()
    t0 = last = time.monotonic()
    windows, last_step = [], 0
    for step in range(cfg.run.steps):
        loss = ops.forward_backward(replica, data(step))
        for flat in flats:
            dist.all_reduce(flat)
            flat.div_(world)
        ops.optimizer_step(replica)  # zeroes the flat buffers in place
        if (step + 1) % SYNC_EVERY == 0 or step + 1 == cfg.run.steps:  # as the threads' sync points
            int(W.param_checksum(params))
            now = time.monotonic()
            windows.append((step + 1 - last_step, now - last))
            last, last_step = now, step + 1
    sync(device)
    step_ms = (time.monotonic() - t0) / cfg.run.steps * 1e3
    fixed = W.shard_batch(sampler.batch(0), 0, world)
    mine = torch.tensor(
        [warmup, step_ms, float(loss), eval_loss(replica, fixed), steady_ms(windows) or float("nan")],
        dtype=torch.float64,
        device=device,
    )
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    ck = torch.tensor([int(W.param_checksum(params))], dtype=torch.int64, device=device)
    cks = [torch.empty_like(ck) for _ in range(world)]
    dist.all_gather(cks, ck)
    dist.destroy_process_group()
    rows = [e.tolist() for e in every]
    checksums = [int(c.item()) for c in cks]
    return {
        "warmup_s": [r[0] for r in rows],
        "step_ms": [r[1] for r in rows],
        "steady_ms": max(r[4] for r in rows),
        "train_losses": [r[2] for r in rows],
        "eval_losses": [r[3] for r in rows],
        "checksums": checksums,
        "policy": policy.reason,
    }


def sync(device) -> None:
    """Wait for the device's queued work (CUDA only)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launch(argv: list[str], timeout: float, log, env: dict) -> tuple[str, list[str]]:
    """Run a child in its own process group; returns (status, output lines)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = "HANG (killed)"
    log.write(f"$ {' '.join(argv[2:])}\n{out}\n")
    log.flush()
    return status, out.splitlines()


def run_variant(cfg_name: str, kind: str, compile_mode: str, world: int, timeout: float, log, args) -> dict:
    """One variant: threads (one child) or processes (world children); parsed results."""
    base = [
        sys.executable,
        __file__,
        "--config",
        cfg_name,
        "--compile",
        compile_mode,
        "--world",
        str(world),
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--hang-dump-s",
        str(max(10.0, timeout - 10)),
    ]
    base += [] if args.pin else ["--no-pin"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS=args.torch_logs)
    if not args.torch_logs:
        del env["TORCH_LOGS"]  # an empty TORCH_LOGS breaks `import torch` (2.13)
    t0 = time.monotonic()
    if kind == "threads":
        status, lines = launch(base + ["--child", "threads"], timeout, log, env)
        results = [json.loads(ln[7:]) for ln in lines if ln.startswith("RESULT ")]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + int(time.time()) % 1000), WORLD_SIZE=str(world))
        procs = []
        for rank in range(world):
            procs.append(
                subprocess.Popen(
                    base + ["--child", "process"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=dict(env, RANK=str(rank)),
                    start_new_session=True,
                )
            )
        status, results, skipped = "ok", [], 0
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
                if proc.returncode != 0:
                    status = f"rank {rank} exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                status = "HANG (killed)"
            log.write(f"$ rank {rank}: {' '.join(base[2:])} --child process\n{out}\n")
            results += [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")][:1]
            skipped += out.count("skipping cudagraphs")
    row = {
        "config": cfg_name,
        "kind": kind,
        "compile": compile_mode,
        "world": world,
        "status": status,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    # perf_hints names every graph that inductor refused to capture; 0 means all were CUDA graphs
    row["skipped_cudagraphs"] = sum("skipping cudagraphs" in ln for ln in lines) if kind == "threads" else skipped
    if results:
        r = results[0]
        row.update(r)
        row["ms"] = max(r["step_ms"])
        row["samples_per_s"] = PER_GPU_BATCH * world / (row["ms"] / 1e3)
        row["params_equal"] = len(set(r["checksums"])) == 1
        row["eval_loss_equal"] = len(set(r["eval_losses"])) == 1
    if status == "ok" and not results:
        row["status"] = "no result"
    return row


PLAN = [
    ("threads", "cudagraphs", 1),
    ("threads", "off", 2),
    ("threads", "default", 2),
    ("threads", "cudagraphs", 2),
    ("procs", "cudagraphs", 2),
]
REPEATED = [("threads", "cudagraphs", 2), ("procs", "cudagraphs", 2)]  # the chosen policy vs its reference


def table(rows: list[dict]) -> str:
    """Markdown table of every run, then the ratios the goals are about."""
    head = (
        "| config | variant | GPUs | rep | status | ms/step per GPU | steady ms/step | samples/s | warm-up s per GPU "
        "| params equal | eval loss equal | graphs not captured |"
    )
    out = [head, "|" + " --- |" * 12]
    for r in rows:
        ms = " / ".join(f"{x:.2f}" for x in r.get("step_ms", [])) or "-"
        warm = " / ".join(f"{x:.1f}" for x in r.get("warmup_s", [])) or "-"
        sps = f"{r['samples_per_s']:.1f}" if "samples_per_s" in r else "-"
        steady = f"{r['steady_ms']:.2f}" if r.get("steady_ms") else "-"
        out.append(
            f"| {r['config']} | {r['kind']} {r['compile']} | {r['world']} | {r.get('rep', 1)} | {r['status']} | "
            f"{ms} | {steady} | {sps} | {warm} | {r.get('params_equal', '-')} | {r.get('eval_loss_equal', '-')} | "
            f"{r.get('skipped_cudagraphs', '-')} |"
        )
    out.append("")
    for cfg in CONFIGS:

        def best(kind, comp, world, key):
            ms = [
                r[key]
                for r in rows
                if (r["config"], r["kind"], r["compile"], r["world"]) == (cfg, kind, comp, world)
                and r["status"] == "ok"
                and r.get(key)
            ]
            return sorted(ms)[len(ms) // 2] if ms else None  # median over repeats

        for key, label in (("ms", "all steps"), ("steady_ms", "steady state")):
            t2, p2, t1 = (
                best("threads", "cudagraphs", 2, key),
                best("procs", "cudagraphs", 2, key),
                best("threads", "cudagraphs", 1, key),
            )
            if t2 and p2:
                out.append(f"{cfg}: threads/procs per-GPU throughput (cudagraphs, {label}) = {p2 / t2:.3f}x")
            if t2 and t1:
                out.append(f"{cfg}: 2-GPU scaling, threads cudagraphs ({label}) = {2 * t1 / t2:.3f}x")
    return "\n".join(out)


def main() -> None:
    """Drive every variant within the time budget, then print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["threads", "process"])
    ap.add_argument("--config", default="small")
    ap.add_argument("--compile", default="cudagraphs")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="small,mid")
    ap.add_argument(
        "--plan",
        default="",
        help="runs to do, in order: config:kind:compile:world,... "
        "(default: every config x PLAN, then REPEATED for repeats 2..)",
    )
    ap.add_argument("--hang-dump-s", type=float, default=0, help="child: dump all threads and exit after this")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (0: the config's default)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="feed pageable batches (A/B of pinning)")
    ap.add_argument(
        "--torch-logs",
        default="perf_hints",
        help="TORCH_LOGS of the children (perf_hints: 'skipping cudagraphs' lines are counted)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the logic")
    args = ap.parse_args()
    if args.child:
        faulthandler.enable()  # a segfault prints every thread's Python stack
        if args.hang_dump_s:
            faulthandler.dump_traceback_later(args.hang_dump_s, exit=True)
        result = child_threads(args) if args.child == "threads" else child_process(args)
        if args.child == "threads" or int(os.environ["RANK"]) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    rows: list[dict] = []
    if args.plan:
        items = [item.split(":") for item in args.plan.split(",")]
        # a variant listed again is a repeat of it
        jobs = [(c, (k, m, int(w)), items[:n].count([c, k, m, w]) + 1) for n, (c, k, m, w) in enumerate(items)]
    else:
        jobs = [(c, v, 1) for c in args.configs.split(",") for v in PLAN]
        jobs += [(c, v, rep) for rep in range(2, args.repeats + 1) for c in args.configs.split(",") for v in REPEATED]
    with open(out / "bench.log", "w") as log:
        log.write(f"torch {torch.__version__} gpus {torch.cuda.device_count()}\n")
        for cfg_name, (kind, comp, world), rep in jobs:
            left = deadline - time.monotonic()
            if left < 30:
                rows.append(
                    {
                        "config": cfg_name,
                        "kind": kind,
                        "compile": comp,
                        "world": world,
                        "rep": rep,
                        "status": "skipped (budget)",
                    }
                )
                continue
            row = run_variant(cfg_name, kind, comp, world, min(TIMEOUT_S[cfg_name], left), log, args)
            row["rep"] = rep
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "policy"}), flush=True)
            (out / "bench.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"\ntorch {torch.__version__}, {torch.cuda.device_count()} x {gpu}, {time.strftime('%Y-%m-%d')}")
    print(table(rows))


if __name__ == "__main__":
    main()
