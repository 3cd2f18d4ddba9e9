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
import os
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
from .loss import LossOutput, dflash_loss
from .model import DFlashDrafter, block_input_ids, block_mask
from .resolve import drafter_spec, resolve_config, summary, worker_devices
from .target import Qwen3Target, build_random_target, build_tiny_target, load_hf_target

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
    # Where the first (compiling) forward/backward is: (what, i, n), read by progress lines.
    at: tuple[str, int, int] = ("", 0, 0)
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
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.to_empty(device="cpu")  # init_weights sets every parameter: skip nn.Linear's own init
    drafter.init_weights(cfg.drafter.init_std, seed)
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
    # Progress probes on the layer loops that run eagerly (inside a compiled graph they would be traced).
    if policy.effective == "off" or scope in ("layers", "drafter"):
        target.on_layer = lambda i, n: setattr(replica, "at", ("target layer", i + 1, n))
    if policy.effective == "off" or scope == "layers":
        drafter.on_layer = lambda i, n: setattr(replica, "at", ("draft layer", i + 1, n))

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
    replica.at = ("forward", 0, 0)
    loss, acceptance = replica.train_loss(b.input_ids, b.loss_mask, b.anchors, b.anchor_valid)
    replica.at = ("backward", 0, 0)
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


def drafter_ops(cfg: Config) -> workers.ReplicaOps:
    """The drafter as the workers' ReplicaOps (build, step, parameters, warm-up progress) for a resolved config."""
    return workers.ReplicaOps(lambda device, seed, policy: build_replica(cfg, device, seed, policy), forward_backward,
                              optimizer_step, lambda replica: list(replica.drafter.parameters()), warmup_progress)


def warmup_progress(replica: Replica) -> str:
    """Where a replica's first forward/backward is: `forward: target layer 12/34`."""
    what, i, n = replica.at
    return f"forward: {what} {i}/{n}" if n else what


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


def use_compile_cache(path: str | None) -> str:
    """Point Inductor's on-disk caches (FX graphs, AOTAutograd, its Triton kernels) at `path`
    before anything compiles, unless the environment already names one; returns the decision.
    Inductor reads TORCHINDUCTOR_CACHE_DIR at its first compile (it has no config key for it)."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        return f"compile cache: {given} (TORCHINDUCTOR_CACHE_DIR from the environment)"
    if path is None:
        return "compile cache: torch's default under the temp dir (run.compile_cache_dir unset)"
    cache = Path(path).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    warm = any(cache.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return f"compile cache: {cache} ({'warm: kept from earlier runs' if warm else 'cold: first run here'})"


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False,
                 stop: StopFlag | None = None, log: Callable[[str], None] = print,
                 launched_at: float | None = None) -> int:
    """Train end to end on every worker device (`run.gpus`, or `run.threads` x `run.device`)
    through `workers.run_threaded`; returns the exit code (128+signal if stopped). A failing
    or stalled worker raises `workers.WorkerError` (with its traceback). `launched_at`: the
    process's start (time.monotonic), for the time-to-first-step line."""
    launched_at = time.monotonic() if launched_at is None else launched_at
    notes: list[str] = []
    cfg = resolve_config(cfg, notes)
    if cfg.run.compile != "off":
        workers.preload_compiler()
    if cfg.run.compile != "off":
        notes.append(use_compile_cache(cfg.run.compile_cache_dir))
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = worker_devices(cfg)
    world = len(devices)
    # Several hosts (WORLD_SIZE > 1, set by `dflashctl train h1,h2`): docs/multihost.md.
    group = distributed.init_from_env(torch.device(devices[0]).type, world, cfg.dist, log=log)
    with group or contextlib.nullcontext():
        return _train(cfg, out, devices, group, resume, overwrite, stop, log, notes, launched_at)


def _train(cfg: Config, out: Path, devices: list[str], group: distributed.NodeGroup | None, resume: bool,
           overwrite: bool, stop: StopFlag | None, log: Callable[[str], None], notes: list[str],
           launched_at: float) -> int:
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

    (out / "config.resolved.yaml").write_text(dump_yaml(cfg))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in DFlashDrafter(drafter_spec(cfg)).parameters())
    policy = workers.choose_compile_policy(cfg.run.compile, torch.device(devices[0]).type)
    for line in summary(cfg, notes, n_params):
        log(line)
    log(f"workers: {world} thread(s) on {', '.join(devices)}, {len(sampler.seqs)} training sequences; "
        f"compile {policy.effective}: {policy.reason}")
    log(f"full config: {out / 'config.resolved.yaml'}")
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
    ops = drafter_ops(cfg)

    def build(device: torch.device, seed: int, pol: workers.CompilePolicy) -> Replica:
        replica = ops.build(device, seed, pol)
        if ckpt is not None:  # every replica loads the same checkpoint: still identical
            load_checkpoint(ckpt, replica.drafter, replica.optimizer, replica.scheduler, device)
        return replica

    state = {"loss_sum": 0.0, "steps": 0, "record_step": start, "t0": time.perf_counter(),
             "untrained": None, "stopped": None}
    threads_at = time.monotonic()

    def run_eval(replica: Replica, step: int, event: str) -> float:
        result = evaluate(replica, eval_batches)
        metrics.write({"event": event, "step": step, "total_steps": total, "loss": result["loss"],
                       "acceptance_length": result["acceptance_length"]})
        log(f"eval step {step}: held-out loss {result['loss']:.4f}, "
            f"teacher-forced acceptance length {result['acceptance_length']:.3f}")
        return result["acceptance_length"]

    def save(replica: Replica, step: int) -> None:
        path = save_checkpoint(out, step, replica.drafter, replica.optimizer, replica.scheduler,
                               to_dict(cfg), replica.device, cfg.run.keep_checkpoints)
        log(f"checkpoint: {path}")

    def on_start(point: workers.SyncPoint) -> None:
        ready_at = time.monotonic()
        if policy.effective != "off":
            log(f"compiled and warmed up: {' / '.join(f'{s:.1f}' for s in point.warmup_s)} s per worker")
        if start == 0:
            state["untrained"] = run_eval(point.replicas[0], 0, "eval")
        now = time.monotonic()
        timing = {"time_to_first_step_s": now - launched_at, "before_workers_s": threads_at - launched_at,
                  "workers_ready_s": ready_at - threads_at, "warmup_s": list(point.warmup_s),
                  "first_eval_s": now - ready_at}
        metrics.write({"event": "start", "step": start, **{k: v for k, v in timing.items()}})
        log(f"time to first step: {timing['time_to_first_step_s']:.1f} s (start-up, config and data "
            f"{timing['before_workers_s']:.1f} s; build, compile and warm-up {timing['workers_ready_s']:.1f} s; "
            f"step-{start} evaluation {timing['first_eval_s']:.1f} s)")
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
            log(f"final held-out teacher-forced acceptance length: {final:.3f}{before} (a proxy: real "
                f"speculative decoding accepts fewer tokens per step)")
        state["t0"] = time.perf_counter()
        return False

    run = cfg.run
    should_stop = group.stop_agreement(lambda: stop.requested) if group else (lambda: stop.requested)
    options = workers.ThreadedOptions(
        compile=run.compile, seed=run.seed, warmup_steps=warmup_steps(policy),
        sync_every=math.gcd(run.log_every, run.eval_every, run.checkpoint_every),
        barrier_timeout_s=run.barrier_timeout_s, compile_timeout_s=run.compile_timeout_s, start_step=start,
        fail_at=cfg.debug.fail_at, hang_at=cfg.debug.hang_at, fail_rank=cfg.debug.fail_rank,
        should_stop=should_stop, stop_before_start=lambda: stop.requested, on_start=on_start,
        on_progress=lambda line: log(line),
        cross_reduce=group.cross_reduce if group else None, cross_check=group.cross_check if group else None)
    result = workers.run_threaded(dataclasses.replace(ops, build=build), devices,
                                  group.sharded(data) if group else data, total, options, on_sync)
    if result.stopped_before_start:
        log(f"stopped by signal {stop.signum} before step {start + 1}: nothing to save")
        return stop.exit_code
    if state["stopped"] is not None:
        by = f"signal {stop.signum}" if stop.requested else "another node's stop request"
        log(f"stopped by {by} after step {state['stopped']}; to continue, run again with --resume")
        return stop.exit_code if stop.requested else 128 + signal.SIGTERM
    return 0
