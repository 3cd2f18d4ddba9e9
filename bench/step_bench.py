"""DFlash drafter training step on one GPU at the published recipe's shapes: ms/step, samples/s,
achieved TFLOP/s, MFU against the bf16 matmul peak measured in the same run, peak memory, and a
per-phase breakdown (CUDA events). Results and their derivation: docs/performance.md.

    cd <repo> && python3 bench/step_bench.py                       # 8b, 4b, 0.6b rows (fast path)
    python3 bench/step_bench.py --shape 8b --batch 2 --steps 6 --warmup 2
    python3 bench/step_bench.py --plan 8b:fast:1,8b:trainer:1      # rows in order, deadline-bounded
    python3 bench/step_bench.py --dry-run                          # CPU, tiny shape: tests the script

Row modes (the trainer's building blocks from remote_payload/dflash_train, weights random):
    fast     draft layers and target layers compiled per layer (`compile_layers`, `--compile`
             policy from plan.choose_compile_policy), fused chunked LM head + CE, fused AdamW
    trainer  what replica.build_replica does today with run.compile=<--compile>: the whole drafter
             torch.compile'd, eager target, eager chunked CE (the pre-fast-path trainer)
    eager    run.compile=off: eager drafter with compiled FlexAttention, eager target, eager CE

FLOPs are counted exactly per sample from the shapes and the sampled anchors (see `count_flops`):
matmuls only, each multiply-add = 2 FLOP; what is and is not counted is printed with the table.
Rows run in order until `--deadline` seconds (wall, from start) would be passed; the table is
printed after every row and last. Full logs and JSON go under --out (default $OUT, else ./bench_out).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_payload"))

# Only modules this bench's fast path is made of; train.py / workers.py are imported lazily (they
# change more often, and the GPU path must not depend on them).
from dflash_train.config import DataConfig, TargetConfig  # noqa: E402
from dflash_train.data import BlockSampler, random_sequences  # noqa: E402
from dflash_train.loss import dflash_loss  # noqa: E402
from dflash_train.model import DFlashDrafter, DrafterSpec, block_input_ids, block_mask  # noqa: E402
from dflash_train.resolve import default_gamma  # noqa: E402
from dflash_train.target import build_random_target, shape_of  # noqa: E402
from dflash_train.target_config import default_target_layer_ids  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

# Target shapes (Qwen3 configs). Drafter: 5 layers of the target's width, 5 feature layers.
SHAPES = {
    "8b": dict(
        num_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "4b": dict(
        num_layers=36,
        hidden_size=2560,
        intermediate_size=9728,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "0.6b": dict(
        num_layers=28,
        hidden_size=1024,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # --dry-run only: a CPU-sized stand-in with the same structure.
    "tiny": dict(
        num_layers=8,
        hidden_size=64,
        intermediate_size=192,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}
PHASES = ("target_fwd", "mask_embed", "drafter_fwd_loss", "backward", "optimizer")


def log(msg: str, fh=None) -> None:
    """Print msg and, given fh, append it to the log file too."""
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


# ----------------------------------------------------------------------------------------------
# FLOPs


def count_flops(
    t: dict, n_draft_layers: int, layer_ids: list[int], seq_len: int, block_size: int, anchors: torch.Tensor
) -> dict[str, float]:
    """Matmul FLOPs of ONE training step for the sequences in `anchors` [N, A], per sample.

    Counted (2 FLOP per multiply-add):
    - target forward over S tokens, layers 0..max(layer_ids) only (early exit, no LM head):
      q/k/v/o projections, SwiGLU MLP, and causal attention QK^T and PV over the visible pairs
      only, S(S+1)/2 per head (the masked upper half is not counted: the kernel skips it).
    - drafter forward: fc (S x L*H -> H); per layer q/o/MLP over the Q = A*B block tokens, k/v
      over S + Q tokens, attention QK^T and PV over the visible (query, key) pairs of the
      block-sparse mask only: block token of anchor a sees a context keys (positions < a) and
      the B tokens of its block, so B * (a + B) pairs per block.
    - drafter backward: 2x the forward of every linear (input and weight gradient) except fc,
      which needs only its weight gradient (its input, the target features, is constant); the
      attention backward as 2x its forward (dV, dP, dQ, dK), not counting the QK^T recompute
      that FlashAttention-style kernels add (that would be +0.5x of the attention forward).
    - LM head over the R = A*(B-1) predicted positions: forward 2*R*H*V plus the input gradient
      2*R*H*V (frozen head: no weight gradient). Padding anchors are computed, so counted.
    Not counted: norms, RoPE, softmax/CE elementwise, embedding gathers, the optimizer.
    """
    h, inter, nh, nkv, d, v = (
        t["hidden_size"],
        t["intermediate_size"],
        t["num_heads"],
        t["num_kv_heads"],
        t["head_dim"],
        t["vocab_size"],
    )
    n, a = anchors.shape
    s, b = seq_len, block_size
    q_tok = a * b
    n_tgt = max(layer_ids) + 1

    def layer_linear(tokens_q: int, tokens_kv: int) -> float:
        return 2.0 * (
            tokens_q * h * nh * d  # q_proj
            + 2 * tokens_kv * h * nkv * d  # k_proj, v_proj
            + tokens_q * nh * d * h  # o_proj
            + 3 * tokens_q * h * inter
        )  # gate, up, down

    tgt_linear = n_tgt * layer_linear(s, s)
    tgt_attn = n_tgt * 2 * (2.0 * nh * d * (s * (s + 1) // 2))  # QK^T + PV, visible pairs
    pairs = (b * (anchors.double() + b)).sum().item() / n  # per sample
    d_attn_fwd = n_draft_layers * 2 * (2.0 * nh * d * pairs)
    d_linear_fwd = n_draft_layers * layer_linear(q_tok, s + q_tok)
    fc_fwd = 2.0 * s * len(layer_ids) * h * h
    rows = a * (b - 1)
    head_fwd = 2.0 * rows * h * v
    out = {
        "target_fwd": tgt_linear + tgt_attn,
        "target_attn": tgt_attn,
        "drafter_fwd": d_linear_fwd + d_attn_fwd + fc_fwd,
        "drafter_bwd": 2 * d_linear_fwd + 2 * d_attn_fwd + fc_fwd,
        "drafter_attn_fwd": d_attn_fwd,
        "lm_head_fwd_bwd": 2 * head_fwd,
        "visible_pairs_per_block_token": pairs / q_tok,
    }
    out["total"] = out["target_fwd"] + out["drafter_fwd"] + out["drafter_bwd"] + out["lm_head_fwd_bwd"]
    return out


# ----------------------------------------------------------------------------------------------
# Build


@dataclasses.dataclass
class BenchConfig:
    """The trainer's qwen3-8b preset values that the step reads (config.py / train.py defaults)."""

    target: TargetConfig
    data: DataConfig
    shape: str
    num_layers: int = 5  # drafter layers
    block_size: int = 16
    layer_ids: tuple = ()
    mask_token_id: int = 0
    dtype: str = "bf16"
    attention: str = "flex"
    gamma: float = 7.0
    loss_chunk_rows: int = 1024
    lr: float = 6e-4
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0


@dataclasses.dataclass
class Rig:
    """What one step uses (the fields of replica.Replica that matter here)."""

    cfg: BenchConfig
    device: torch.device
    target: torch.nn.Module
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_drafter: object
    flex_fn: object


def make_config(shape: str, batch: int, dry: bool) -> BenchConfig:
    """BenchConfig for shape and batch: 3072 tokens, bf16, flex attention; dry run: 64 tokens, fp32, dense."""
    t = TargetConfig(**SHAPES[shape], rope_theta=1e6, init_std=0.02)
    seq, anchors = (64, 8) if dry else (3072, 512)
    data = DataConfig(
        source="random",
        max_length=seq,
        anchors_per_seq=anchors,
        batch_size=batch,
        num_train=max(8, batch * 4),
        num_eval=0,
    )
    return BenchConfig(
        t,
        data,
        shape,
        layer_ids=tuple(default_target_layer_ids(t.num_layers, 5)),
        mask_token_id=t.vocab_size - 1,
        dtype="fp32" if dry else "bf16",
        attention="dense" if dry else "flex",
        gamma=default_gamma(16),
    )


def compile_policy(mode: str, device_type: str):
    """plan.choose_compile_policy if importable, else the equivalent plain choice."""
    try:
        from dflash_train.plan import choose_compile_policy

        p = choose_compile_policy(mode, device_type)
        return p.effective, dict(p.options or {}), p.reason
    except Exception as exc:  # noqa: BLE001 (a concurrent edit of plan.py must not stop a GPU run)
        return ("off" if mode == "off" else "default"), {}, f"plan.py not importable: {exc}"


# FlexAttention kernel options to try in `fast` rows (a plan row's optional fourth field), over the
# trainer's (none: the kernel's defaults, row guards kept). "unguarded" drops the guards with the
# forward key tile widened to the mask's 128, safe in the trainer's layout (model.py): it bought
# nothing at the 8B shape (H200, 2026-12-06).
FLEX_VARIANTS = {
    "unguarded": {"ROWS_GUARANTEED_SAFE": True, "fwd_BLOCK_N": 128, "fwd_num_stages": 2},
    "tma": {"USE_TMA": True},
    "bwd64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64},
    "bwd32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_warps": 4},
    "fwd64": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64},
}


def flex_with(options: dict):
    """flex_attention with `options` over the kernel options its caller (model.attend) passes."""

    def flex(q, k, v, kernel_options=None, **kwargs):
        return flex_attention(q, k, v, kernel_options={**(kernel_options or {}), **options}, **kwargs)

    return flex


def build(cfg: BenchConfig, mode: str, compile_mode: str, device: torch.device, fh, flex: str = "") -> Rig:
    """Target (early exit), drafter, fused AdamW and schedule on `device`, initialised there
    (random weights: speed does not depend on values), compiled per `mode`."""
    dtype = torch.float32 if cfg.dtype == "fp32" else torch.bfloat16
    target = build_random_target(cfg.target, 0, max(cfg.layer_ids) + 1, device, dtype)
    spec = DrafterSpec(shape_of(cfg.target), cfg.num_layers, cfg.block_size, cfg.layer_ids, cfg.mask_token_id)
    with torch.device("meta"):
        drafter = DFlashDrafter(spec)
    drafter.to_empty(device="cpu")
    drafter.init_weights(0.02, 0)  # as the trainer does: drawn on the CPU, in parallel
    drafter.to(device)
    optimizer = torch.optim.AdamW(
        drafter.parameters(),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=1e-8,
        weight_decay=0.0,
        fused=True if device.type == "cuda" else None,
    )
    warm = 40  # 4% of 1000 steps, then cosine (replica.WarmupCosine); the values do not affect speed
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warm))
    run_drafter, flex_fn = drafter, flex_attention
    effective, options, reason = compile_policy(compile_mode, device.type)
    kw = {"dynamic": False}
    if options:
        kw["options"] = options
    if mode == "eager" or effective == "off":
        if cfg.attention == "flex":
            flex_fn = torch.compile(flex_attention, dynamic=False)  # as replica.build_replica does
    elif mode == "fast":
        if flex:
            flex_fn = flex_with(FLEX_VARIANTS[flex])
        drafter.compile_layers(**kw)
        target.compile_layers(**kw)
    else:
        run_drafter = torch.compile(drafter, **kw)
    log(f"  compile policy: {compile_mode} -> {effective} ({reason}); mode {mode} {FLEX_VARIANTS.get(flex, '')}", fh)
    return Rig(cfg, device, target, drafter, optimizer, scheduler, run_drafter, flex_fn)


def dry_check_against_trainer(rig: Rig, batch, fh) -> None:
    """CPU dry run: the bench's step loss equals replica.forward_loss's on the same weights/batch."""
    from dflash_train.config import load_config
    from dflash_train.plan import resolve_run
    from dflash_train.replica import build_replica, forward_loss

    t = rig.cfg.target
    over = [
        f"target.{f.name}={json.dumps(getattr(t, f.name))}" for f in dataclasses.fields(t) if f.name not in ("path",)
    ]
    d = rig.cfg.data
    over += [
        f"data.max_length={d.max_length}",
        f"data.anchors_per_seq={d.anchors_per_seq}",
        f"data.batch_size={d.batch_size}",
        f"data.num_train={d.num_train}",
        "data.num_eval=1",
        f"drafter.mask_token_id={rig.cfg.mask_token_id}",
        "run.device=cpu",
        "run.compile=off",
        "run.dtype=fp32",
        "drafter.attention=dense",
        "run.steps=1000",
    ]
    plan = resolve_run(load_config(preset="qwen3-8b", overrides=over))
    cfg = plan.cfg
    assert tuple(cfg.drafter.target_layer_ids) == rig.cfg.layer_ids and cfg.optim.gamma == rig.cfg.gamma
    replica = build_replica(cfg, "cpu", 0, plan.policy)
    # The replica builds the whole target (its decoder needs every layer) and so draws another LM
    # head from the same seed; the bench's target stops at the last feature layer: share its weights.
    missing, unexpected = replica.target.load_state_dict(rig.target.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
    replica.drafter.load_state_dict(rig.drafter.state_dict())
    ref = float(forward_loss(replica, batch).loss)
    ours = float(step(rig, batch, False, None))
    rig.drafter.zero_grad(set_to_none=True)
    assert abs(ours - ref) <= 1e-6 * abs(ref), (ours, ref)
    log(f"  dry run: bench step loss {ours:.6f} == replica.forward_loss {ref:.6f}", fh)


def step(rep: Rig, b, fused: bool, events: list | None):
    """One training step = replica.forward_loss + backward + replica.optimizer_step, split into the
    phases of PHASES with an event before each. Returns the detached loss."""

    def mark(i):
        if events is not None:
            events[i].record()

    cfg, dev = rep.cfg, rep.device
    spec = rep.drafter.spec
    bs = spec.block_size
    n, s = b.input_ids.shape
    a = b.anchors.shape[1]
    mark(0)
    feats = rep.target.features(b.input_ids, spec.target_layer_ids)
    mark(1)
    block_ids = block_input_ids(b.input_ids, b.anchors, bs, spec.mask_token_id)
    embeds = rep.target.embed_tokens(block_ids)
    mask = block_mask(b.anchors, s, bs, cfg.attention)
    mark(2)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
        hidden = rep.run_drafter(feats, embeds, b.anchors, mask, rep.flex_fn)
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:]
    label_pos = (b.anchors[:, :, None] + torch.arange(1, bs, device=dev)).flatten(1)
    labels = b.input_ids.gather(1, label_pos).view(n, a, bs - 1)
    label_mask = b.loss_mask.gather(1, label_pos).view(n, a, bs - 1) & b.anchor_valid[:, :, None]
    out = dflash_loss(
        hidden, rep.target.lm_head.weight, labels, label_mask, b.anchor_valid, cfg.gamma, cfg.loss_chunk_rows, fused
    )
    mark(3)
    out.loss.backward()
    mark(4)
    torch.nn.utils.clip_grad_norm_(rep.drafter.parameters(), cfg.grad_clip)
    rep.optimizer.step()
    rep.optimizer.zero_grad(set_to_none=True)
    rep.scheduler.step()
    mark(5)
    return out.loss.detach()


# ----------------------------------------------------------------------------------------------
# Measurements


def matmul_peak(device: torch.device, n: int, reps: int) -> float:
    """bf16 n x n x n matmul TFLOP/s on random data: median over reps, rotating 2 input sets."""
    if device.type != "cuda":
        return float("nan")
    xs = [
        (torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16))
        for _ in range(2)
    ]
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for i in range(3):
        torch.matmul(*xs[i % 2], out=out)
    times = []
    for i in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.matmul(*xs[i % 2], out=out)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del xs, out
    return 2.0 * n**3 / statistics.median(times) / 1e12


def run_row(shape: str, mode: str, batch: int, args, device: torch.device, peak: float, fh, flex: str = "") -> dict:
    """Build, warm up and time one (shape, mode, batch) row; returns its speed, FLOPs, memory and phases."""
    dry = args.dry_run
    cfg = make_config(shape, batch, dry)
    t0 = time.perf_counter()
    rep = build(cfg, mode, args.compile, device, fh, flex)
    seqs = random_sequences(cfg.target.vocab_size, cfg.data.num_train, cfg.data.max_length, cfg.mask_token_id, 0)
    sampler = BlockSampler(seqs, cfg.data, cfg.block_size, 0)
    n_steps = args.warmup + args.steps
    batches = [sampler.batch(i).to(device) for i in range(n_steps)]
    fused = mode == "fast" and device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    build_s = time.perf_counter() - t0
    row = {
        "shape": shape,
        "mode": f"{mode}+{flex}" if flex else mode,
        "compile": args.compile,
        "batch": batch,
        "fused_ce": fused,
        "build_s": round(build_s, 1),
    }
    if dry:
        dry_check_against_trainer(rep, batches[0], fh)
        row["loss_matches_forward_loss"] = True
    warm_times, losses = [], []
    for i in range(args.warmup):
        t1 = time.perf_counter()
        losses.append(float(step(rep, batches[i], fused, None)))
        sync()
        warm_times.append(round(time.perf_counter() - t1, 2))
    row["warmup_s"] = warm_times
    row["first_loss"] = losses[0] if losses else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    per_step = []
    if device.type == "cuda":
        evs = [[torch.cuda.Event(enable_timing=True) for _ in range(6)] for _ in range(args.steps)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(args.steps):
            step(rep, batches[args.warmup + i], fused, evs[i])
        end.record()
        end.synchronize()
        total_ms = start.elapsed_time(end) / args.steps
        for ev in evs:
            per_step.append([ev[j].elapsed_time(ev[j + 1]) for j in range(5)])
    else:
        t1 = time.perf_counter()
        for i in range(args.steps):
            step(rep, batches[args.warmup + i], fused, None)
        total_ms = (time.perf_counter() - t1) * 1e3 / args.steps
    flops = [
        count_flops(SHAPES[shape], cfg.num_layers, list(cfg.layer_ids), cfg.data.max_length, cfg.block_size, b.anchors)
        for b in batches[args.warmup :]
    ]
    f = {k: statistics.mean(x[k] for x in flops) for k in flops[0]}
    step_flops = f["total"] * batch
    row.update(
        {
            "ms_per_step": round(total_ms, 2),
            "samples_per_s": round(batch * 1e3 / total_ms, 3),
            "tflop_per_sample": round(f["total"] / 1e12, 3),
            "tflops": round(step_flops / (total_ms / 1e3) / 1e12, 1),
            "mfu": round(step_flops / (total_ms / 1e3) / (peak * 1e12), 4) if peak == peak else None,
            "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None,
            "flops_per_sample": {k: v for k, v in f.items()},
        }
    )
    if per_step:
        med = [statistics.median(x[j] for x in per_step) for j in range(5)]
        row["phases_ms"] = dict(zip(PHASES, [round(m, 2) for m in med]))
        fl = {
            "target_fwd": f["target_fwd"] * batch,
            "drafter_fwd_loss": (f["drafter_fwd"] + f["lm_head_fwd_bwd"]) * batch,
            "backward": f["drafter_bwd"] * batch,
        }
        row["phase_tflops"] = {k: round(fl[k] / (row["phases_ms"][k] / 1e3) / 1e12, 1) for k in fl}
    if args.profile and device.type == "cuda" and shape == args.profile_shape and not getattr(args, "_profiled", False):
        args._profiled = True
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(rep, batches[-1], fused, None)
                torch.cuda.synchronize()
            avg = prof.key_averages()
            try:
                text = avg.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
            except Exception:  # noqa: BLE001 (older key name)
                text = avg.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
            (Path(args.out) / f"profile_{shape}_{mode}_b{batch}.txt").write_text(text)
            log("profile (top by device time, one step):\n" + "\n".join(text.splitlines()[:26]), fh)
        except Exception:  # noqa: BLE001 (the row's numbers are already taken)
            log("profile failed:\n" + traceback.format_exc(), fh)
    del rep, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], peak: float) -> str:
    """The rows so far as a markdown table, headed by the measured matmul peak."""
    lines = [
        f"peak bf16 matmul (measured, median): {peak:.0f} TFLOP/s",
        "| shape | mode | batch | ms/step | samples/s | TFLOP/sample | TFLOP/s | MFU | peak GiB | "
        "target fwd | mask+embed | drafter fwd+LM head | backward | optimizer | first loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['mode']} | {r['batch']} | failed: {r['error'][:80]} |")
            continue
        ph = r.get("phases_ms", {})
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(
            f"| {r['shape']} | {r['mode']} | {r['batch']} | {r['ms_per_step']:.1f} | {r['samples_per_s']:.2f} | "
            f"{r['tflop_per_sample']:.1f} | {r['tflops']:.0f} | {mfu} | {r['peak_mem_gib']} | "
            + " | ".join(f"{ph[p]:.1f}" if p in ph else "-" for p in PHASES)
            + f" | {r['first_loss']:.4f} |"
        )
    return "\n".join(lines)


def plan_row(text: str) -> tuple[str, str, int, str]:
    """shape:mode:batch[:flex variant] -> its fields."""
    shape, mode, batch, *flex = text.split(":")
    if flex and (flex[0] not in FLEX_VARIANTS or mode != "fast"):
        raise SystemExit(f"{text}: a flex variant is one of {', '.join(FLEX_VARIANTS)}, in a fast row")
    return shape, mode, int(batch), flex[0] if flex else ""


def main(argv=None) -> int:
    """Run the plan's rows within the deadline, logging each; write step_bench.json; 0 if all rows ran."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=[s for s in SHAPES if s != "tiny"],
        default=None,
        help="one row of this shape (default: the plan)",
    )
    p.add_argument("--mode", choices=("fast", "trainer", "eager"), default="fast")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--compile",
        choices=("off", "default", "cudagraphs"),
        default=None,
        help="compile policy, through plan.choose_compile_policy (default: default; off for --dry-run)",
    )
    p.add_argument(
        "--plan",
        default="8b:fast:1,4b:fast:1,0.6b:fast:1",
        help="rows shape:mode:batch[:flex variant], run in order while the deadline allows",
    )
    p.add_argument("--deadline", type=float, default=0, help="seconds of wall time for all rows (0: none)")
    p.add_argument("--profile", action="store_true", help="torch.profiler of one step of the first row")
    p.add_argument("--profile-shape", default="8b")
    p.add_argument("--peak-n", type=int, default=8192)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, fp32, dense mask")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = "off" if args.dry_run else "default"
    t_start = time.perf_counter()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fh = open(Path(args.out) / "step_bench.log", "w")
    torch._dynamo.config.cache_size_limit = 64
    if args.dry_run:
        device = torch.device("cpu")
        plan = [("tiny", args.mode, args.batch, "")]
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        plan = [(args.shape, args.mode, args.batch, "")] if args.shape else [plan_row(x) for x in args.plan.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    log(
        f"torch {torch.__version__}, triton "
        f"{getattr(sys.modules.get('triton'), '__version__', 'n/a')}, device {name}; "
        f"steps {args.steps} (+{args.warmup} warm-up); compile {args.compile}",
        fh,
    )
    peak = matmul_peak(device, args.peak_n, 20)
    log(f"peak bf16 matmul {args.peak_n}^3: {peak:.0f} TFLOP/s", fh)
    rows: list[dict] = []
    est_row_s = 90.0  # first-row guess (compile + warm-up); later rows: 0.9 x the slowest seen
    for shape, mode, batch, flex in plan:
        left = args.deadline - (time.perf_counter() - t_start) if args.deadline else float("inf")
        if left < est_row_s:
            log(f"skip {shape}:{mode}:{batch}: {left:.0f} s left, a row took up to {est_row_s:.0f} s", fh)
            continue
        log(f"row {shape} {mode} batch {batch} ...", fh)
        t_row = time.perf_counter()
        try:
            r = run_row(shape, mode, batch, args, device, peak, fh, flex)
        except Exception as exc:  # keep the other rows
            log(traceback.format_exc(), fh)
            r = {"shape": shape, "mode": mode, "batch": batch, "error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r["row_s"] = round(time.perf_counter() - t_row, 1)
        if "error" not in r:
            est_row_s = max(est_row_s if rows else 0, r["row_s"] * 0.9)
        rows.append(r)
        log(json.dumps(r), fh)
        log(table(rows, peak), fh)
    result = {
        "torch": torch.__version__,
        "device": name,
        "peak_tflops": peak,
        "rows": rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    (Path(args.out) / "step_bench.json").write_text(json.dumps(result, indent=1))
    log(
        "\nFLOPs counted: matmuls only (see count_flops): target fwd to the last feature layer with causal "
        "attention over visible pairs; drafter fwd + 2x bwd (fc: weight grad only; attention over the "
        "block mask's visible pairs, no recompute); LM head fwd + input grad over A*(B-1) rows.",
        fh,
    )
    log(table(rows, peak), fh)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
