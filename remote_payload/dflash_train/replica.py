"""One drafter replica and the step functions the worker threads run on it: build_replica,
forward_backward, optimizer_step (and the held-out evaluation). A step depends only on (replica,
batch): no module-level mutable state, so one replica per thread per device is safe. The
program that drives them is train.py; the threads are workers.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import flex_attention

from . import workers
from .compiling import CompilePolicy
from .config import Config
from .data import Batch
from .loss import LossOutput, dflash_loss
from .model import DFlashDrafter, block_input_ids, to_empty
from .resolve import drafter_spec
from .sliding import drafter_masks
from .target import Qwen3Target, build_random_target, build_tiny_target, load_hf_target
from .target_hf import build_hf_target
from .target_graph import GraphedFeatures

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_target(cfg: Config, device: torch.device) -> Qwen3Target:
    """The frozen target on `device` in the run dtype (loaded, or random from the config seed)."""
    dtype, t = DTYPES[cfg.run.dtype], cfg.target
    whole = cfg.run.spec_prompts > 0  # speculative decoding needs every layer; features stop early anyway
    if t.backend == "transformers":
        return build_hf_target(t, cfg.drafter.target_layer_ids, device, dtype, whole)
    if t.path is not None:
        return load_hf_target(t.path, cfg.drafter.target_layer_ids, device, dtype, whole)
    if cfg.data.source == "demo":
        # The same weights that generated the demo data (built on CPU: identical on every machine).
        return build_tiny_target(t, t.seed).to(device=device, dtype=dtype)
    return build_random_target(t, t.seed, None if whole else max(cfg.drafter.target_layer_ids) + 1, device, dtype)


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
    policy: CompilePolicy
    train_loss: Callable  # (input_ids, loss_mask, anchors, anchor_valid) -> (loss, acceptance), compiled per policy
    run_drafter: Callable  # the drafter, or its compiled wrapper (run.compile_scope: drafter)
    flex_fn: Callable  # flex_attention for the eager paths (compiled on its own on CUDA)
    # Where the first (compiling) forward/backward is: (what, i, n), read by progress lines.
    at: tuple[str, int, int] = ("", 0, 0)
    # Last step's values, read at sync points only (no host sync per step):
    last_lr: float = 0.0
    last_grad_norm: torch.Tensor | None = None
    last_acceptance: torch.Tensor | None = None
    # run.capture_optimizer: clip + AdamW + zero grads as one CUDA graph, captured at warm-up
    # (`capture_optimizer_step`); its output slot holds the last replay's gradient norm.
    capture_step: bool = False
    step_graph: torch.cuda.CUDAGraph | None = None
    graph_norm: torch.Tensor | None = None
    # run.capture_target on: the target's feature forward as one CUDA graph, captured at warm-up
    # (`capture_target_forward`); the training step's loss then reads the features from it.
    target_graph: GraphedFeatures | None = None


def build_replica(cfg: Config, device: torch.device | str, seed: int, policy: CompilePolicy) -> Replica:
    """Target, drafter (initialised from `seed` on CPU, so identical on every device), AdamW and
    schedule for a resolved config; compiled through the run plan's `policy` (plan.resolve_run).
    Its scope `step` compiles the whole loss (target features, block mask, drafter, chunked CE) as
    one function; `drafter` compiles only the drafter; `layers` compiles each draft and target
    layer (regional, `compile_layers`; never with CUDA graphs: config.py refuses the pair)."""
    device = torch.device(device)
    target = build_target(cfg, device)
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_spec(cfg))
    to_empty(drafter, "cpu")  # init_weights sets every parameter: skip nn.Linear's own init
    drafter.init_weights(cfg.drafter.init_std, seed)
    drafter.to(device)
    on_cuda = device.type == "cuda"
    capture = policy.capture_optimizer
    optimizer, scheduler = _build_optimizer(cfg, drafter, device, capture)
    flex_fn = flex_attention
    if cfg.drafter.attention == "flex" and on_cuda and policy.effective != "off":
        flex_fn = torch.compile(flex_attention, dynamic=False)  # eager flex is unfused and slow
    run_drafter = drafter
    scope = policy.scope
    if policy.effective != "off" and scope == "drafter":
        run_drafter = policy.compile(drafter)
    elif policy.effective != "off" and scope == "layers":
        drafter.compile_layers()  # regional (docs/performance.md): names and state_dict unchanged
        target.compile_layers()
    replica = Replica(
        cfg, device, target, drafter, optimizer, scheduler, policy, None, run_drafter, flex_fn, capture_step=capture
    )
    # Progress probes on the layer loops that run eagerly (inside a compiled graph they would be traced).
    if policy.effective == "off" or scope in ("layers", "drafter"):
        target.on_layer = lambda i, n: setattr(replica, "at", ("target layer", i + 1, n))
    if policy.effective == "off" or scope == "layers":
        drafter.on_layer = lambda i, n: setattr(replica, "at", ("draft layer", i + 1, n))

    if policy.effective != "off" and scope == "step":

        def train_loss(input_ids, loss_mask, anchors, anchor_valid):
            # flex_attention itself is traced into the graph (the standalone compiled one is for eager paths)
            out = _loss(replica, input_ids, loss_mask, anchors, anchor_valid, drafter, flex_attention)
            return out.loss, out.acceptance_length

        replica.train_loss = policy.compile(train_loss)
    else:
        # A compiled drafter traces flex_attention itself; an eager one uses the compiled flex.
        train_flex = flex_attention if run_drafter is not drafter else flex_fn

        def train_loss(input_ids, loss_mask, anchors, anchor_valid):
            out = _loss(
                replica, input_ids, loss_mask, anchors, anchor_valid, run_drafter, train_flex, replica.target_graph
            )
            return out.loss, out.acceptance_length

        replica.train_loss = train_loss
    return replica


def _build_optimizer(
    cfg: Config, drafter: torch.nn.Module, device: torch.device, capture: bool
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused on CUDA; capturable when the optimizer step runs in a CUDA graph) and its
    warm-up + cosine schedule."""
    o = cfg.optim
    # Captured: the graph reads lr from device memory, so lr is a tensor the schedule fills in place.
    lr = torch.tensor(o.lr, device=device) if capture else o.lr
    optimizer = torch.optim.AdamW(
        drafter.parameters(),
        lr=lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True if device.type == "cuda" else None,
        capturable=capture,
    )
    for group in optimizer.param_groups:
        group["initial_lr"] = o.lr  # a float base lr: a tensor one would cost a host sync per scheduler step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(cfg.run.steps, o.warmup_ratio, o.min_lr_ratio)
    )
    return optimizer, scheduler


def _loss(
    replica: Replica,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    drafter: Callable,
    flex_fn: Callable,
    features: Callable | None = None,
) -> LossOutput:
    """Target features -> drafter over all blocks -> decayed CE and acceptance length (tensors on
    the replica's device; traceable as a whole by torch.compile). `features`: what computes the
    target's features (default `target.features`; the captured graph in training steps)."""
    cfg, dev = replica.cfg, replica.device
    spec = replica.drafter.spec
    bs = spec.block_size
    n, s = input_ids.shape
    a = anchors.shape[1]
    feats = (features or replica.target.features)(input_ids, spec.target_layer_ids)  # [N, S, L*H]
    block_ids = block_input_ids(input_ids, anchors, bs, spec.mask_token_id)  # [N, A*B]
    embeds = replica.target.embed_tokens(block_ids)  # [N, A*B, H]
    mask = drafter_masks(anchors, s, spec, cfg.drafter.attention)  # once per batch
    use_bf16 = cfg.run.dtype == "bf16"
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
        hidden = drafter(feats, embeds, anchors, mask, flex_fn)  # [N, A*B, H]
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:]  # [N, A, B-1, H]
    label_pos = (anchors[:, :, None] + torch.arange(1, bs, device=dev)).flatten(1)  # [N, A*(B-1)]
    labels = input_ids.gather(1, label_pos).view(n, a, bs - 1)
    label_mask = loss_mask.gather(1, label_pos).view(n, a, bs - 1) & anchor_valid[:, :, None]
    # The compiled CE chunk only on CUDA and only when compiling is allowed (`run.compile: off`
    # must mean no torch.compile anywhere, e.g. while debugging the compiler).
    fused = dev.type == "cuda" and cfg.run.compile != "off"
    return dflash_loss(
        hidden,
        replica.target.lm_head.weight,
        labels,
        label_mask,
        anchor_valid,
        cfg.optim.gamma,
        cfg.optim.loss_chunk_rows,
        fused,
    )


def forward_loss(replica: Replica, batch: Batch) -> LossOutput:
    """The loss of one batch through the uncompiled drafter (evaluation, tests, benchmarks):
    no recompile or CUDA-graph capture for a new grad mode or batch shape."""
    b = batch.to(replica.device)
    return _loss(replica, b.input_ids, b.loss_mask, b.anchors, b.anchor_valid, replica.drafter, replica.flex_fn)


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


def scheduled_lr(replica: Replica) -> float:
    """The lr the next optimizer step uses, computed on the host (LambdaLR's own formula): reading
    a tensor lr would sync with the device."""
    sched = replica.scheduler
    return sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch)


def clip_step_zero(replica: Replica, keep_grads: bool = True) -> torch.Tensor:
    """Clip, AdamW step, zero grads (in place when keep_grads, else set to None): the optimizer
    step's device work, eager or captured; returns the pre-clip grad norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(replica.drafter.parameters(), replica.cfg.optim.grad_clip)
    replica.optimizer.step()
    replica.optimizer.zero_grad(set_to_none=not keep_grads)
    return grad_norm.detach()


def optimizer_step(replica: Replica, keep_grads: bool = True) -> torch.Tensor:
    """Clip, AdamW step, zero grads (in place when keep_grads: the workers' flat gradient buffers
    stay attached; else set to None), advance the schedule; returns the pre-clip grad norm (a
    device tensor: no host sync). With a captured step graph (whose run keeps flat buffers), the
    first three are one replay."""
    replica.last_lr = scheduled_lr(replica)
    if replica.step_graph is not None:
        replica.step_graph.replay()
        replica.last_grad_norm = replica.graph_norm
    else:
        replica.last_grad_norm = clip_step_zero(replica, keep_grads)
    replica.scheduler.step()
    return replica.last_grad_norm


def optimizer_tensors(replica: Replica) -> list[torch.Tensor]:
    """Parameters and every tensor of the optimizer state (step counts, moments), in a fixed order."""
    state = [
        t
        for p in replica.drafter.parameters()
        for t in replica.optimizer.state.get(p, {}).values()
        if isinstance(t, torch.Tensor)
    ]
    return list(replica.drafter.parameters()) + state


def capture_optimizer_step(replica: Replica) -> None:
    """Capture `clip_step_zero` as a CUDA graph (run.capture_optimizer; a no-op elsewhere), leaving
    parameters and optimizer state as they were. Called by the worker under the warm-up lock with
    the gradients zeroed and attached to their flat buffers (fixed addresses, as the graph needs).

    Eager calls on a side stream first create the optimizer state and any lazy handles
    (PyTorch's recipe for capturing a capturable optimizer), then are undone in place
    (`rehearse_optimizer_step`); capture itself runs no kernel (`workers.capture_graph`: safe for
    the same reason as inductor's own capture, docs/threaded-compile.md)."""
    if not replica.capture_step:
        return
    for group in replica.optimizer.param_groups:
        # A checkpoint from an uncaptured run brings a float lr and capturable False: the graph
        # would bake that lr in, and the capture check refuses capturable False.
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], device=replica.device)
        group["capturable"] = True
    replica.step_graph, replica.graph_norm = workers.capture_graph(
        replica.device, lambda: rehearse_optimizer_step(replica), lambda: clip_step_zero(replica)
    )


def rehearse_optimizer_step(replica: Replica) -> None:
    """Run the optimizer step twice (the first creates the optimizer state, the second runs as
    every later step will) and undo both in place: parameters and state that existed before are
    copied back, state created since is zeroed (AdamW's initial value). Every tensor keeps its
    address, so a graph captured afterwards reads and writes the live ones."""
    before = {id(t): t.detach().clone() for t in optimizer_tensors(replica)}
    for _ in range(2):
        clip_step_zero(replica)
    undo_in_place(optimizer_tensors(replica), before)


@torch.no_grad()
def undo_in_place(tensors: list[torch.Tensor], before: dict[int, torch.Tensor]) -> None:
    """Put `tensors` back to `before` (copies by id) in place; a tensor with no copy (optimizer state
    created since) is zeroed, its initial value in AdamW."""
    for t in tensors:
        if id(t) in before:
            t.copy_(before[id(t)])
        else:
            t.zero_()


def capture_target_forward(replica: Replica) -> None:
    """Capture the target's feature forward for the training batch shape (run.capture_target on;
    a no-op otherwise). Called by the worker under the warm-up lock, after the compiling forward."""
    cfg = replica.cfg
    if not replica.policy.capture_target:
        return
    shape = (cfg.data.batch_size, cfg.data.max_length)  # collate pads every batch to this
    try:
        replica.target_graph = GraphedFeatures(
            replica.target, replica.drafter.spec.target_layer_ids, shape, replica.device
        )
    except RuntimeError as exc:
        raise RuntimeError(
            f"capturing the target's forward as a CUDA graph failed ({exc}); "
            f"set run.capture_target=off to launch it layer by layer"
        ) from exc


def capture_graphs(replica: Replica) -> None:
    """The warm-up's captures: the target's feature forward, then the optimizer step."""
    capture_target_forward(replica)
    capture_optimizer_step(replica)


def drafter_ops(cfg: Config) -> workers.ReplicaOps:
    """The drafter as the workers' ReplicaOps (build, step, parameters, warm-up progress) for a resolved config."""
    return workers.ReplicaOps(
        lambda device, seed, policy: build_replica(cfg, device, seed, policy),
        forward_backward,
        optimizer_step,
        lambda replica: list(replica.drafter.parameters()),
        warmup_progress,
        capture_graphs,
    )


def warmup_progress(replica: Replica) -> str:
    """Where a replica's first forward/backward is: `forward: target layer 12/34`."""
    what, i, n = replica.at
    return f"forward: {what} {i}/{n}" if n else what


def stop_progress_probes(replica: Replica) -> None:
    """Take the warm-up's progress probes off the layer loops (every later step would pay them)."""
    replica.target.on_layer = replica.drafter.on_layer = None


def train_step(replica: Replica, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One full step on one replica; metrics stay tensors (no device sync) except the lr used."""
    loss = forward_backward(replica, batch)
    grad_norm = optimizer_step(replica)
    return loss, {"grad_norm": grad_norm, "lr": replica.last_lr, "train_acceptance_length": replica.last_acceptance}


@torch.no_grad()
def evaluate(replica: Replica, batches: list[Batch]) -> dict[str, float]:
    """Held-out loss and teacher-forced acceptance length, weighted by valid blocks."""
    loss_sum = acc_sum = blocks = 0.0
    for batch in batches:
        out = forward_loss(replica, batch)
        k = float(out.num_blocks)
        loss_sum, acc_sum, blocks = (
            loss_sum + float(out.loss) * k,
            acc_sum + float(out.acceptance_length) * k,
            blocks + k,
        )
    return {"loss": loss_sum / max(blocks, 1.0), "acceptance_length": acc_sum / max(blocks, 1.0)}
