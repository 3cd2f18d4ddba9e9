"""One training worker (CPU or one GPU), built from public step functions that the threaded
multi-GPU workers reuse: build_replica, forward_backward, optimizer_step.

A step depends only on (replica, batch): no module-level mutable state, so one replica per thread
per GPU is safe.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from .checkpoint import StopFlag, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, dump_yaml, to_dict
from .data import Batch, BlockSampler, build_datasets
from .export import export_drafter
from .loss import LossOutput, default_gamma, dflash_loss
from .model import DFlashDrafter, DrafterSpec, block_input_ids, block_mask
from .target import (Qwen3Target, build_random_target, build_tiny_target, default_target_layer_ids,
                     load_hf_target, read_hf_config, resolve_mask_token_id, shape_of)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_config(cfg: Config) -> Config:
    """A copy with every `auto`/None filled in (device, dtype, compile, attention, target shape,
    feature layers, MASK id, gamma, export dir); raises ConfigError on inconsistencies."""
    cfg = copy.deepcopy(cfg)
    run, d = cfg.run, cfg.drafter
    if run.device == "auto":
        run.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = torch.device(run.device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise ConfigError(f"run.device {run.device} requested but CUDA is not available")
    if run.dtype == "auto":
        run.dtype = "bf16" if on_cuda else "fp32"
    if run.compile is None:
        run.compile = "default" if on_cuda else "off"
    if d.attention == "auto":
        d.attention = "flex" if on_cuda else "dense"
    if d.attention == "flex" and not on_cuda:
        raise ConfigError("drafter.attention flex needs CUDA (FlexAttention has no CPU backward)")
    if cfg.target.path is not None:
        try:
            loaded = read_hf_config(cfg.target.path)
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"target.path: {exc}") from None
        loaded.seed, loaded.init_std = cfg.target.seed, cfg.target.init_std
        cfg.target = loaded
    if d.target_layer_ids is None:
        d.target_layer_ids = default_target_layer_ids(cfg.target.num_layers, d.num_target_features)
    if not d.target_layer_ids or not all(0 <= i < cfg.target.num_layers for i in d.target_layer_ids):
        raise ConfigError(f"drafter.target_layer_ids {d.target_layer_ids} must lie in "
                          f"[0, {cfg.target.num_layers - 1}]")
    try:
        d.mask_token_id = resolve_mask_token_id(cfg.target, d.mask_token_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.optim.gamma is None:
        cfg.optim.gamma = default_gamma(d.block_size)
    if run.export_dir is None:
        run.export_dir = str(Path(run.output_dir) / "export")
    return cfg


def drafter_spec(cfg: Config) -> DrafterSpec:
    """The drafter's architecture from a resolved config."""
    d = cfg.drafter
    return DrafterSpec(shape_of(cfg.target), d.num_layers, d.block_size, tuple(d.target_layer_ids),
                       d.mask_token_id)


def build_target(cfg: Config, device: torch.device) -> Qwen3Target:
    """The frozen target on `device` in the run dtype (loaded, or random from the config seed)."""
    dtype, t = DTYPES[cfg.run.dtype], cfg.target
    if t.path is not None:
        return load_hf_target(t.path, cfg.drafter.target_layer_ids, device, dtype)
    if cfg.data.source == "demo":
        # The same weights that generated the demo data (built on CPU: identical on every machine).
        return build_tiny_target(t, t.seed).to(device=device, dtype=dtype)
    return build_random_target(t, t.seed, max(cfg.drafter.target_layer_ids) + 1, device, dtype)


class WarmupCosine:
    """LR multiplier: linear warmup over `warmup_ratio` of the steps, then cosine to `min_ratio`."""

    def __init__(self, total_steps: int, warmup_ratio: float, min_ratio: float):
        self.total = total_steps
        self.warmup = max(1, math.ceil(warmup_ratio * total_steps))
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Replica:
    """Everything one worker trains with; built by `build_replica`."""

    cfg: Config
    device: torch.device
    target: Qwen3Target
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_drafter: Callable  # the drafter, or its torch.compile'd wrapper
    flex_fn: Callable      # flex_attention (compiled on its own when the drafter is not)


def build_replica(cfg: Config, device: torch.device | str, seed: int) -> Replica:
    """Target, drafter (initialised from `seed` on CPU, so identical on every device), AdamW and
    schedule for a resolved config; compiles the drafter per `run.compile`."""
    device = torch.device(device)
    target = build_target(cfg, device)
    drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.init_weights(cfg.drafter.init_std, torch.Generator().manual_seed(seed))
    drafter.to(device)
    o = cfg.optim
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(cfg.run.steps, o.warmup_ratio, o.min_lr_ratio))
    policy = cfg.run.compile
    run_drafter, flex_fn = drafter, flex_attention
    if policy == "off" and cfg.drafter.attention == "flex" and device.type == "cuda":
        flex_fn = torch.compile(flex_attention, dynamic=False)  # eager flex is unfused and slow
    elif policy != "off":
        run_drafter = torch.compile(drafter, mode="reduce-overhead" if policy == "cudagraphs" else None,
                                    dynamic=False)
    return Replica(cfg, device, target, drafter, optimizer, scheduler, run_drafter, flex_fn)


def forward_loss(replica: Replica, batch: Batch) -> LossOutput:
    """Target features -> drafter over all blocks -> decayed CE and acceptance length."""
    cfg, dev = replica.cfg, replica.device
    b = batch.to(dev)
    spec = replica.drafter.spec
    bs = spec.block_size
    n, s = b.input_ids.shape
    a = b.anchors.shape[1]
    feats = replica.target.features(b.input_ids, spec.target_layer_ids)                  # [N, S, L*H]
    block_ids = block_input_ids(b.input_ids, b.anchors, bs, spec.mask_token_id)        # [N, A*B]
    embeds = replica.target.embed_tokens(block_ids)                                     # [N, A*B, H]
    mask = block_mask(b.anchors, s, bs, cfg.drafter.attention)                          # once per batch
    use_bf16 = cfg.run.dtype == "bf16"
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
        hidden = replica.run_drafter(feats, embeds, b.anchors, mask, replica.flex_fn)   # [N, A*B, H]
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:]                                        # [N, A, B-1, H]
    label_pos = (b.anchors[:, :, None] + torch.arange(1, bs, device=dev)).flatten(1)   # [N, A*(B-1)]
    labels = b.input_ids.gather(1, label_pos).view(n, a, bs - 1)
    label_mask = b.loss_mask.gather(1, label_pos).view(n, a, bs - 1) & b.anchor_valid[:, :, None]
    return dflash_loss(hidden, replica.target.lm_head.weight, labels, label_mask, b.anchor_valid,
                       cfg.optim.gamma, cfg.optim.loss_chunk_rows)


def forward_backward(replica: Replica, batch: Batch) -> torch.Tensor:
    """Forward and backward of one batch (gradients accumulate); returns the detached loss."""
    out = forward_loss(replica, batch)
    out.loss.backward()
    return out.loss.detach()


def optimizer_step(replica: Replica) -> torch.Tensor:
    """Clip, AdamW step, zero grads, advance the schedule; returns the pre-clip grad norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(replica.drafter.parameters(), replica.cfg.optim.grad_clip)
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=True)
    replica.scheduler.step()
    return grad_norm.detach()


def train_step(replica: Replica, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One full step; metrics stay tensors (no device sync) except the lr used."""
    lr = replica.optimizer.param_groups[0]["lr"]
    out = forward_loss(replica, batch)
    out.loss.backward()
    grad_norm = optimizer_step(replica)
    return out.loss.detach(), {"grad_norm": grad_norm, "lr": lr,
                               "train_acceptance_length": out.acceptance_length}


@torch.no_grad()
def evaluate(replica: Replica, batches: list[Batch]) -> dict[str, float]:
    """Held-out loss and teacher-forced acceptance length, weighted by valid blocks."""
    loss_sum = acc_sum = blocks = 0.0
    for batch in batches:
        out = forward_loss(replica, batch)
        k = float(out.num_blocks)
        loss_sum, acc_sum, blocks = loss_sum + float(out.loss) * k, acc_sum + float(out.acceptance_length) * k, blocks + k
    return {"loss": loss_sum / max(blocks, 1.0), "acceptance_length": acc_sum / max(blocks, 1.0)}


# ----------------------------------------------------------------------------------------------
# The program.


def load_data(cfg: Config) -> tuple[BlockSampler, list[Batch]]:
    """The training sampler and the fixed held-out batches (first epoch's anchors, unshuffled)."""
    train_seqs, eval_seqs = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train_seqs, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    eval_cfg = dataclasses.replace(cfg.data, batch_size=min(cfg.data.batch_size, len(eval_seqs)))
    held_out = BlockSampler(eval_seqs, eval_cfg, cfg.drafter.block_size, cfg.run.seed + 1, shuffle=False)
    return sampler, [held_out.batch(i) for i in range(min(cfg.run.eval_batches, held_out.steps_per_epoch))]


class MetricsLog:
    """Appends JSON lines to <out>/metrics.jsonl."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            # Drop what the interrupted run logged after its last checkpoint.
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        """Append one record."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def _gpu_mem_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False,
                 stop: StopFlag | None = None, log: Callable[[str], None] = print) -> int:
    """Train one worker end to end; returns the process exit code (128+signal if stopped)."""
    cfg = resolve_config(cfg)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = latest_checkpoint(out) if resume else None
    if not resume and latest_checkpoint(out) is not None and not overwrite:
        raise ConfigError(f"{out} already has checkpoints: pass --resume to continue or --overwrite")
    torch.manual_seed(cfg.run.seed)
    if cfg.run.cpu_threads > 0:
        torch.set_num_threads(cfg.run.cpu_threads)

    sampler, eval_batches = load_data(cfg)
    if cfg.run.epochs > 0:
        cfg.run.steps = cfg.run.epochs * sampler.steps_per_epoch

    text = dump_yaml(cfg)
    (out / "config.resolved.yaml").write_text(text)
    log("resolved config:\n" + text.rstrip())

    device = torch.device(cfg.run.device)
    replica = build_replica(cfg, device, cfg.run.seed)
    n_params = sum(p.numel() for p in replica.drafter.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M trainable parameters; target layers "
        f"{cfg.drafter.target_layer_ids}; {len(sampler.seqs)} training sequences")
    if resume and ckpt is None:
        log(f"no checkpoint in {out}: starting from step 0")

    start = 0
    if ckpt is not None:
        meta = load_checkpoint(ckpt, replica.drafter, replica.optimizer, replica.scheduler, device)
        start = meta["step"]
        log(f"resumed from {ckpt} at step {start}")
        changed = _changed_keys(meta["config"], to_dict(cfg))
        if changed:
            log(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
    metrics = MetricsLog(out / "metrics.jsonl", start if ckpt is not None else None)
    total = cfg.run.steps

    def save(step: int) -> None:
        path = save_checkpoint(out, step, replica.drafter, replica.optimizer, replica.scheduler,
                               to_dict(cfg), device, cfg.run.keep_checkpoints)
        log(f"checkpoint: {path}")

    def run_eval(step: int, event: str) -> float:
        result = evaluate(replica, eval_batches)
        metrics.write({"event": event, "step": step, "total_steps": total, "loss": result["loss"],
                       "acceptance_length": result["acceptance_length"]})
        log(f"eval step {step}: held-out loss {result['loss']:.4f}, "
            f"acceptance length {result['acceptance_length']:.3f}")
        return result["acceptance_length"]

    untrained = run_eval(0, "eval") if start == 0 else None
    stop = stop or StopFlag()
    window_loss, window_steps, window_tokens = torch.zeros((), device=device), 0, 0
    _sync(device)
    t0 = time.perf_counter()
    for step in range(start, total):
        batch = sampler.batch(step)
        loss, m = train_step(replica, batch)
        window_loss += loss
        window_steps += 1
        window_tokens += batch.num_tokens
        done = step + 1
        eval_now = done % cfg.run.eval_every == 0 and done < total
        if done % cfg.run.log_every == 0 or done == total or eval_now or stop.requested:
            _sync(device)
            elapsed = time.perf_counter() - t0
            record = {"event": "train", "step": done, "total_steps": total,
                      "loss": float(window_loss) / window_steps, "acceptance_length": None,
                      "lr": m["lr"], "grad_norm": float(m["grad_norm"]),
                      "tokens_per_s": window_tokens / elapsed, "step_time_s": elapsed / window_steps,
                      "gpu_mem_gb": _gpu_mem_gb(device),
                      "train_acceptance_length": float(m["train_acceptance_length"])}
            if eval_now:
                record["acceptance_length"] = run_eval(done, "eval")
            metrics.write(record)
            log(f"step {done}/{total} loss {record['loss']:.4f} lr {m['lr']:.2e} "
                f"gnorm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
                f"{record['step_time_s'] * 1000:.1f} ms/step")
            window_loss.zero_()
            window_steps = window_tokens = 0
            _sync(device)
            t0 = time.perf_counter()
        if done % cfg.run.checkpoint_every == 0 or done == total or stop.requested:
            save(done)
        if stop.requested:
            log(f"stopped by signal {stop.signum} after step {done}; resume with --resume")
            return stop.exit_code

    final = run_eval(total, "final")
    export_dir = export_drafter(replica.drafter, cfg.target, cfg.run.export_dir, DTYPES[cfg.run.dtype])
    log(f"exported drafter to {export_dir}")
    before = f" (untrained: {untrained:.3f})" if untrained is not None else ""
    log(f"final held-out acceptance length: {final:.3f}{before}")
    return 0

