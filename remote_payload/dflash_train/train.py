"""The training program and the step functions the worker threads run: build_replica,
forward_backward, optimizer_step.

Every run, one device or several, goes through `workers.run_threaded` (one thread per device; a
single device is the same loop with one thread). A step depends only on (replica, batch): no
module-level mutable state, so one replica per thread per device is safe.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from . import distributed, workers
from .checkpoint import StopFlag, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, dump_yaml, to_dict
from .data import Batch, BlockSampler, DataError, build_datasets
from .export import export_drafter
from .loss import LossOutput, default_gamma, dflash_loss
from .model import DFlashDrafter, DrafterSpec, block_input_ids, block_mask
from .target import (Qwen3Target, build_random_target, build_tiny_target, default_target_layer_ids,
                     load_hf_target, read_hf_config, resolve_mask_token_id, shape_of)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def auto_attention(on_cuda: bool, compile_mode: str) -> str:
    """`drafter.attention: auto`: FlexAttention when it can be compiled (CUDA and compiling), else
    dense SDPA. `run.compile: off` is the escape hatch from a broken compiler, so it must not
    compile anything, and eager flex is only a slow dense reference."""
    return "flex" if on_cuda and compile_mode != "off" else "dense"


def resolve_config(cfg: Config) -> Config:
    """A copy with every `auto`/None filled in (device, dtype, compile, attention, target shape,
    feature layers, MASK id, gamma, export dir); raises ConfigError on inconsistencies."""
    cfg = copy.deepcopy(cfg)
    run, d = cfg.run, cfg.drafter
    if run.gpus:
        if run.device not in ("auto", "cuda", f"cuda:{run.gpus[0]}"):
            raise ConfigError(f"run.gpus {run.gpus} contradicts run.device {run.device}: set one of them")
        if not torch.cuda.is_available():
            raise ConfigError(f"run.gpus {run.gpus} requested but CUDA is not available")
        if max(run.gpus) >= torch.cuda.device_count():
            raise ConfigError(f"run.gpus {run.gpus}: torch sees {torch.cuda.device_count()} GPU(s)")
        run.device = f"cuda:{run.gpus[0]}"
        run.threads = len(run.gpus)
    run.threads = run.threads or 1
    if run.device == "auto":
        run.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        on_cuda = torch.device(run.device).type == "cuda"
    except RuntimeError:
        raise ConfigError(f"run.device {run.device!r} is not a device (cpu, cuda, cuda:N)") from None
    if on_cuda and not torch.cuda.is_available():
        raise ConfigError(f"run.device {run.device} requested but CUDA is not available")
    if cfg.debug.fail_rank >= run.threads and (cfg.debug.fail_at or cfg.debug.hang_at):
        raise ConfigError(f"debug.fail_rank {cfg.debug.fail_rank} but only {run.threads} worker(s)")
    if run.dtype == "auto":
        run.dtype = "bf16" if on_cuda else "fp32"
    if run.compile is None:
        run.compile = "default" if on_cuda else "off"
    if d.attention == "auto":
        d.attention = auto_attention(on_cuda, run.compile)
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
        d.mask_token_id = resolve_mask_token_id(cfg.target, d.mask_token_id, cfg.data.tokenizer_path)
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
    policy: workers.CompilePolicy
    train_loss: Callable   # (input_ids, loss_mask, anchors, anchor_valid) -> (loss, acceptance), compiled per policy
    run_drafter: Callable  # the drafter, or its compiled wrapper (run.compile_scope: drafter)
    flex_fn: Callable      # flex_attention for the eager paths (compiled on its own on CUDA)
    # Last step's values, read at sync points only (no host sync per step):
    last_lr: float = 0.0
    last_grad_norm: torch.Tensor | None = None
    last_acceptance: torch.Tensor | None = None


def build_replica(cfg: Config, device: torch.device | str, seed: int,
                  policy: workers.CompilePolicy | None = None) -> Replica:
    """Target, drafter (initialised from `seed` on CPU, so identical on every device), AdamW and
    schedule for a resolved config; compiled through `policy` (default: the workers' policy for
    `run.compile` on this device, `workers.choose_compile_policy`, which never uses CUDAGraph
    Trees). `run.compile_scope: step` compiles the whole loss (target features, block mask,
    drafter, chunked CE) as one function; `drafter` compiles only the drafter; `layers` compiles
    each draft and target layer (regional, `compile_layers`; not with CUDA graphs)."""
    device = torch.device(device)
    policy = policy or workers.choose_compile_policy(cfg.run.compile, device.type)
    target = build_target(cfg, device)
    drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.init_weights(cfg.drafter.init_std, torch.Generator().manual_seed(seed))
    drafter.to(device)
    o = cfg.optim
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True if on_cuda else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(cfg.run.steps, o.warmup_ratio, o.min_lr_ratio))
    flex_fn = flex_attention
    if cfg.drafter.attention == "flex" and on_cuda and policy.effective != "off":
        flex_fn = torch.compile(flex_attention, dynamic=False)  # eager flex is unfused and slow
    run_drafter = drafter
    scope = cfg.run.compile_scope
    if policy.effective != "off" and scope == "drafter":
        run_drafter = policy.compile(drafter)
    elif policy.effective != "off" and scope == "layers":
        if policy.effective == "cudagraphs":
            # One compiled layer serves every layer with other parameters: the tree-less CUDA
            # graph path assumes fixed parameter addresses per graph (docs/threaded-compile.md).
            raise ConfigError("run.compile_scope layers cannot use run.compile cudagraphs (use step)")
        drafter.compile_layers()  # regional (docs/performance.md): names and state_dict unchanged
        target.compile_layers()
    replica = Replica(cfg, device, target, drafter, optimizer, scheduler, policy, None, run_drafter, flex_fn)

    if policy.effective != "off" and cfg.run.compile_scope == "step":
        def train_loss(input_ids, loss_mask, anchors, anchor_valid):
            # flex_attention itself is traced into the graph (the standalone compiled one is for eager paths)
            out = _loss(replica, input_ids, loss_mask, anchors, anchor_valid, drafter, flex_attention)
            return out.loss, out.acceptance_length
        replica.train_loss = policy.compile(train_loss)
    else:
        # A compiled drafter traces flex_attention itself; an eager one uses the compiled flex.
        train_flex = flex_attention if run_drafter is not drafter else flex_fn

        def train_loss(input_ids, loss_mask, anchors, anchor_valid):
            out = _loss(replica, input_ids, loss_mask, anchors, anchor_valid, run_drafter, train_flex)
            return out.loss, out.acceptance_length
        replica.train_loss = train_loss
    return replica


def _loss(replica: Replica, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
          anchor_valid: torch.Tensor, drafter: Callable, flex_fn: Callable) -> LossOutput:
    """Target features -> drafter over all blocks -> decayed CE and acceptance length (tensors on
    the replica's device; traceable as a whole by torch.compile)."""
    cfg, dev = replica.cfg, replica.device
    spec = replica.drafter.spec
    bs = spec.block_size
    n, s = input_ids.shape
    a = anchors.shape[1]
    feats = replica.target.features(input_ids, spec.target_layer_ids)                    # [N, S, L*H]
    block_ids = block_input_ids(input_ids, anchors, bs, spec.mask_token_id)              # [N, A*B]
    embeds = replica.target.embed_tokens(block_ids)                                       # [N, A*B, H]
    mask = block_mask(anchors, s, bs, cfg.drafter.attention)                              # once per batch
    use_bf16 = cfg.run.dtype == "bf16"
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
        hidden = drafter(feats, embeds, anchors, mask, flex_fn)                           # [N, A*B, H]
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:]                                          # [N, A, B-1, H]
    label_pos = (anchors[:, :, None] + torch.arange(1, bs, device=dev)).flatten(1)       # [N, A*(B-1)]
    labels = input_ids.gather(1, label_pos).view(n, a, bs - 1)
    label_mask = loss_mask.gather(1, label_pos).view(n, a, bs - 1) & anchor_valid[:, :, None]
    # The compiled CE chunk only on CUDA and only when compiling is allowed (`run.compile: off`
    # must mean no torch.compile anywhere, e.g. while debugging the compiler).
    fused = dev.type == "cuda" and cfg.run.compile != "off"
    return dflash_loss(hidden, replica.target.lm_head.weight, labels, label_mask, anchor_valid,
                       cfg.optim.gamma, cfg.optim.loss_chunk_rows, fused)


def forward_loss(replica: Replica, batch: Batch) -> LossOutput:
    """The loss of one batch through the uncompiled drafter (evaluation, tests, benchmarks):
    no recompile or CUDA-graph capture for a new grad mode or batch shape."""
    b = batch.to(replica.device)
    return _loss(replica, b.input_ids, b.loss_mask, b.anchors, b.anchor_valid, replica.drafter,
                 replica.flex_fn)


def forward_backward(replica: Replica, batch: Batch) -> torch.Tensor:
    """Forward and backward of one batch through the compiled step (gradients accumulate in
    .grad); returns the detached loss and keeps the batch's acceptance length on the replica."""
    b = batch.to(replica.device)
    loss, acceptance = replica.train_loss(b.input_ids, b.loss_mask, b.anchors, b.anchor_valid)
    loss.backward()
    replica.last_acceptance = acceptance.detach()
    return loss.detach()


def optimizer_step(replica: Replica) -> torch.Tensor:
    """Clip, AdamW step, zero grads in place (the workers' flat gradient buffers stay attached),
    advance the schedule; returns the pre-clip grad norm (a device tensor: no host sync)."""
    replica.last_lr = replica.optimizer.param_groups[0]["lr"]
    grad_norm = torch.nn.utils.clip_grad_norm_(replica.drafter.parameters(), replica.cfg.optim.grad_clip)
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=False)
    replica.scheduler.step()
    replica.last_grad_norm = grad_norm.detach()
    return replica.last_grad_norm


def train_step(replica: Replica, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One full step on one replica; metrics stay tensors (no device sync) except the lr used."""
    loss = forward_backward(replica, batch)
    grad_norm = optimizer_step(replica)
    return loss, {"grad_norm": grad_norm, "lr": replica.last_lr,
                  "train_acceptance_length": replica.last_acceptance}


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


def load_data(cfg: Config, world: int = 1) -> tuple[BlockSampler, list[Batch]]:
    """The sampler of global batches (`data.batch_size` sequences per replica, `world` replicas)
    and the fixed held-out batches (first epoch's anchors, unshuffled, one replica's size)."""
    try:
        train_seqs, eval_seqs = build_datasets(cfg, cfg.drafter.mask_token_id)
    except (DataError, OSError) as exc:  # bad input: one line for the user, like a bad config
        raise ConfigError(f"data: {exc}") from None
    global_cfg = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * world)
    try:
        sampler = BlockSampler(train_seqs, global_cfg, cfg.drafter.block_size, cfg.run.seed)
    except ValueError as exc:
        raise ConfigError(f"{exc} (data.batch_size {cfg.data.batch_size} x {world} worker(s))") from None
    eval_cfg = dataclasses.replace(cfg.data, batch_size=min(cfg.data.batch_size, len(eval_seqs)))
    held_out = BlockSampler(eval_seqs, eval_cfg, cfg.drafter.block_size, cfg.run.seed + 1, shuffle=False)
    return sampler, [held_out.batch(i) for i in range(min(cfg.run.eval_batches, held_out.steps_per_epoch))]


def worker_devices(cfg: Config) -> list[str]:
    """One device per worker thread of a resolved config: the GPUs of `run.gpus`, else
    `run.threads` replicas on `run.device`."""
    if cfg.run.gpus:
        return [f"cuda:{g}" for g in cfg.run.gpus]
    return [cfg.run.device] * cfg.run.threads


class GlobalBatches:
    """`data(step, rank, world)` for run_threaded: each global batch is built once (by the first
    worker to ask) and sliced per rank; its token count is kept for tokens/s. `pin`: keep batches
    in page-locked memory (for CUDA workers; the slices stay pinned)."""

    def __init__(self, sampler: BlockSampler, pin: bool = False):
        self.sampler = sampler
        self.pin = pin
        self.lock = threading.Lock()
        self.cache: dict[int, Batch] = {}
        self.tokens: dict[int, int] = {}

    def __call__(self, step: int, rank: int, world: int) -> Batch:
        with self.lock:
            batch = self.cache.get(step)
            if batch is None:
                batch = self.sampler.batch(step)
                batch = self.cache[step] = batch.pinned() if self.pin else batch
                self.tokens[step] = batch.num_tokens
                # Workers are at most one step apart (a barrier per step): older batches are done.
                for old in [s for s in self.cache if s < step - 1]:
                    del self.cache[old]
        return workers.shard_batch(batch, rank, world) if world > 1 else batch

    def take_tokens(self, first: int, last: int) -> int:
        """Tokens of the global batches of 0-based steps first..last-1, forgotten afterwards."""
        with self.lock:
            total = sum(self.tokens.pop(s, 0) for s in range(first, last))
            for old in [s for s in self.tokens if s < first]:
                del self.tokens[old]
        return total


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


def _gpu_mem_gb(devices: list[torch.device]) -> float | None:
    """Peak allocated memory of the most loaded worker GPU (None on CPU)."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not cuda:
        return None
    return round(max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30, 3)


def warmup_steps(policy: workers.CompilePolicy) -> int:
    """Forward/backward calls under the warm-up lock: none eager, one to compile, two to compile
    and then capture the CUDA graphs (the tree-less path captures on the second call)."""
    return {"off": 0, "default": 1, "cudagraphs": 2}[policy.effective]


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False,
                 stop: StopFlag | None = None, log: Callable[[str], None] = print) -> int:
    """Train end to end on every worker device (`run.gpus`, or `run.threads` x `run.device`)
    through `workers.run_threaded`; returns the exit code (128+signal if stopped). A failing
    or stalled worker raises `workers.WorkerError` (with its traceback)."""
    cfg = resolve_config(cfg)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = worker_devices(cfg)
    world = len(devices)
    # Several hosts (WORLD_SIZE > 1, set by `dflashctl train h1,h2`): docs/multihost.md.
    group = distributed.init_from_env(torch.device(devices[0]).type, world, cfg.dist, log=log)
    with group or contextlib.nullcontext():
        return _train(cfg, out, devices, group, resume, overwrite, stop, log)


def _train(cfg: Config, out: Path, devices: list[str], group: distributed.NodeGroup | None, resume: bool,
           overwrite: bool, stop: StopFlag | None, log: Callable[[str], None]) -> int:
    world = len(devices)
    main = group is None or group.is_main  # only rank 0 writes checkpoints and the export
    if group is not None and resume:
        ckpt = group.sync_checkpoint(out)  # rank 0's latest, on every node
    else:
        ckpt = latest_checkpoint(out) if resume else None
    if not resume and latest_checkpoint(out) is not None and not overwrite:
        raise ConfigError(f"{out} already has checkpoints: pass --resume to continue or --overwrite")
    torch.manual_seed(cfg.run.seed)
    if cfg.run.cpu_threads > 0:
        torch.set_num_threads(cfg.run.cpu_threads)

    sampler, eval_batches = load_data(cfg, group.total_replicas if group else world)
    if cfg.run.epochs > 0:
        cfg.run.steps = cfg.run.epochs * sampler.steps_per_epoch

    text = dump_yaml(cfg)
    (out / "config.resolved.yaml").write_text(text)
    log("resolved config:\n" + text.rstrip())
    with torch.device("meta"):
        n_params = sum(p.numel() for p in DFlashDrafter(drafter_spec(cfg)).parameters())
    policy = workers.choose_compile_policy(cfg.run.compile, torch.device(devices[0]).type)
    log(f"drafter: {n_params / 1e6:.2f}M trainable parameters; target layers "
        f"{cfg.drafter.target_layer_ids}; {len(sampler.seqs)} training sequences")
    log(f"workers: {world} thread(s) on {', '.join(devices)}; {cfg.data.batch_size} sequences each per step; "
        f"compile {policy.effective} ({cfg.run.compile_scope}): {policy.reason}")
    if resume and ckpt is None:
        log(f"no checkpoint in {out}: starting from step 0")

    start = 0
    if ckpt is not None:
        meta = json.loads((ckpt / "meta.json").read_text())
        start = meta["step"]
        log(f"resuming from {ckpt} at step {start}")
        changed = _changed_keys(meta["config"], to_dict(cfg))
        if changed:
            log(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
    metrics = MetricsLog(out / "metrics.jsonl", start if ckpt is not None else None)
    total = cfg.run.steps
    if start >= total:
        log(f"checkpoint step {start} is already at run.steps {total}: nothing to train")
        return 0
    stop = stop or StopFlag()
    data = GlobalBatches(sampler, pin=any(torch.device(d).type == "cuda" for d in devices))
    ops = workers.drafter_ops(cfg)

    def build(device: torch.device, seed: int, pol: workers.CompilePolicy) -> Replica:
        replica = ops.build(device, seed, pol)
        if ckpt is not None:  # every replica loads the same checkpoint: still identical
            load_checkpoint(ckpt, replica.drafter, replica.optimizer, replica.scheduler, device)
        return replica

    state = {"loss_sum": 0.0, "steps": 0, "record_step": start, "t0": time.perf_counter(),
             "untrained": None, "stopped": None}

    def run_eval(replica: Replica, step: int, event: str) -> float:
        result = evaluate(replica, eval_batches)
        metrics.write({"event": event, "step": step, "total_steps": total, "loss": result["loss"],
                       "acceptance_length": result["acceptance_length"]})
        log(f"eval step {step}: held-out loss {result['loss']:.4f}, "
            f"acceptance length {result['acceptance_length']:.3f}")
        return result["acceptance_length"]

    def save(replica: Replica, step: int) -> None:
        path = save_checkpoint(out, step, replica.drafter, replica.optimizer, replica.scheduler,
                               to_dict(cfg), replica.device, cfg.run.keep_checkpoints)
        log(f"checkpoint: {path}")

    def on_start(point: workers.SyncPoint) -> None:
        if policy.effective != "off":
            log(f"compiled and warmed up: {' / '.join(f'{s:.1f}' for s in point.warmup_s)} s per worker")
        if start == 0:
            state["untrained"] = run_eval(point.replicas[0], 0, "eval")
        state["t0"] = time.perf_counter()

    def on_sync(point: workers.SyncPoint) -> bool:
        """Rank 0's thread, every other worker waiting: metrics, eval, checkpoint, export."""
        replica, done = point.replicas[0], point.step
        state["loss_sum"] += group.mean(point.loss_sums) if group else sum(point.loss_sums) / world
        state["steps"] += point.steps_since_last
        stopping = should_stop.requested if group else stop.requested
        eval_now = done % cfg.run.eval_every == 0 and done < total
        if done % cfg.run.log_every == 0 or done == total or eval_now or stopping:
            elapsed = time.perf_counter() - state["t0"]
            steps = max(state["steps"], 1)
            tokens = data.take_tokens(state["record_step"], done)
            record = {"event": "train", "step": done, "total_steps": total,
                      "loss": state["loss_sum"] / steps, "acceptance_length": None,
                      "lr": replica.last_lr, "grad_norm": float(replica.last_grad_norm),
                      "tokens_per_s": tokens / elapsed, "step_time_s": elapsed / steps,
                      "gpu_mem_gb": _gpu_mem_gb([r.device for r in point.replicas]),
                      "train_acceptance_length": float(replica.last_acceptance)}
            if eval_now:
                record["acceptance_length"] = run_eval(replica, done, "eval")
            metrics.write(record)
            log(f"step {done}/{total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"gnorm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
                f"{record['step_time_s'] * 1000:.1f} ms/step")
            state.update(loss_sum=0.0, steps=0, record_step=done)
        if main and (done % cfg.run.checkpoint_every == 0 or done == total or stopping):
            save(replica, done)
        if stopping:
            state["stopped"] = done
            return True
        if done == total:
            log(f"workers: {world} replica(s) in sync at step {done} (parameter checksum {point.checksum})")
            final = run_eval(replica, total, "final")
            if main:
                export_dir = export_drafter(replica.drafter, cfg.target, cfg.run.export_dir, DTYPES[cfg.run.dtype])
                log(f"exported drafter to {export_dir}")
            before = f" (untrained: {state['untrained']:.3f})" if state["untrained"] is not None else ""
            log(f"final held-out acceptance length: {final:.3f}{before}")
        state["t0"] = time.perf_counter()
        return False

    run = cfg.run
    should_stop = group.stop_agreement(lambda: stop.requested) if group else (lambda: stop.requested)
    options = workers.ThreadedOptions(
        compile=run.compile, seed=run.seed, warmup_steps=warmup_steps(policy),
        sync_every=math.gcd(run.log_every, run.eval_every, run.checkpoint_every),
        barrier_timeout_s=run.barrier_timeout_s, compile_timeout_s=run.compile_timeout_s, start_step=start,
        fail_at=cfg.debug.fail_at, hang_at=cfg.debug.hang_at, fail_rank=cfg.debug.fail_rank,
        should_stop=should_stop, on_start=on_start,
        cross_reduce=group.cross_reduce if group else None, cross_check=group.cross_check if group else None)
    workers.run_threaded(workers.ReplicaOps(build, ops.forward_backward, ops.optimizer_step, ops.parameters),
                         devices, group.sharded(data) if group else data, total, options, on_sync)
    if state["stopped"] is not None:
        by = f"signal {stop.signum}" if stop.requested else "another node's stop request"
        log(f"stopped by {by} after step {state['stopped']}; resume with --resume")
        return stop.exit_code if stop.requested else 128 + signal.SIGTERM
    return 0
