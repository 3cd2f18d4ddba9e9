"""DFlash loss: position-decayed cross-entropy through the frozen LM head, computed in row chunks,
and the teacher-forced acceptance length."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def position_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1: [B-1] fp32."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def _head_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """fp32 logits [r, V] of one chunk, their log-sum-exp, per-row CE and argmax."""
    logits = (hidden.to(weight.dtype) @ weight.T).float()  # [r, V]
    lse = logits.logsumexp(-1)  # [r]
    ce = lse - logits.gather(1, labels[:, None])[:, 0]
    return logits, lse, ce, logits.argmax(-1)


def _ce_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """One chunk, out of place (the form Inductor fuses): hidden [r, H], weight [V, H], labels [r]
    -> (ce [r] fp32, argmax [r], d ce / d hidden [r, H] or None).

    Compiled, the fp32 logits never exist in memory: the bf16 matmul output is read by one
    reduction kernel (max, sum-exp, argmax, target logit) and one pointwise kernel that writes
    softmax - onehot in bf16 for the second matmul, about 3 passes over r x V bf16 instead of the
    ~12 r x V bf16-equivalents eager `_ce_chunk_inplace` moves. Same math, same fp32 rounding.
    """
    logits, lse, ce, pred = _head_stats(hidden, weight, labels)
    if not need_grad:
        return ce, pred, None
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels[:, None]
    probs = (logits - lse[:, None]).exp() - onehot.to(logits.dtype)  # softmax - onehot
    return ce, pred, (probs.to(weight.dtype) @ weight).to(hidden.dtype)


def _ce_chunk_inplace(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """`_ce_chunk` for eager mode: the softmax is formed in place in the fp32 logits buffer, so one
    chunk peaks at one [r, V] fp32 tensor (plus the matmul's bf16 output)."""
    logits, lse, ce, pred = _head_stats(hidden, weight, labels)
    if not need_grad:
        return ce, pred, None
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place
    probs[torch.arange(probs.shape[0], device=probs.device), labels] -= 1.0
    return ce, pred, (probs.to(weight.dtype) @ weight).to(hidden.dtype)


@functools.cache
def _ce_chunk_compiled():
    """The compiled `_ce_chunk` (made on first use, so CPU-only imports never load Dynamo).
    `dynamic=False` with equal-sized chunks (`ChunkedHeadCE.forward`) gives one graph per
    (rows, H, V, need_grad); Dynamo serialises compiles across threads."""
    return torch.compile(_ce_chunk, dynamic=False)


class ChunkedHeadCE(torch.autograd.Function):
    """Per-row cross-entropy and argmax of `hidden @ weight.T`, `chunk_rows` rows at a time.

    Only one chunk of logits [chunk_rows, V] exists at once: the gradient w.r.t. `hidden`
    ((softmax - onehot) @ weight, [R, H]) is computed in the same pass and kept instead of the
    logits. `weight` is the frozen LM head and gets no gradient. `fused`: "eager" (in place),
    "compiled" (each chunk through the compiled `_ce_chunk`) or "traced" (`_ce_chunk` inside an
    enclosing compile); the last two split the rows evenly, so one compiled shape serves all.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows: int, need_grad: bool, fused: str = "eager"):
        # hidden: [R, H]; weight: [V, H]; labels: [R] -> ce [R] fp32, argmax [R] long
        rows = hidden.shape[0]
        if fused != "eager":
            chunks = max(1, -(-rows // chunk_rows))
            chunk_rows = -(-rows // chunks)  # even split: at most 2 distinct chunk shapes
        if fused == "compiled":
            fn = _ce_chunk_compiled()
        elif fused == "traced":
            fn = _ce_chunk
        else:
            fn = _ce_chunk_inplace
        ce = hidden.new_empty(rows, dtype=torch.float32)
        pred = labels.new_empty(rows)
        grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            ce[start:end], pred[start:end], g = fn(hidden[start:end], weight, labels[start:end], need_grad)
            if need_grad:
                grad[start:end] = g
        ctx.mark_non_differentiable(pred)
        if need_grad:
            ctx.save_for_backward(grad)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce[:, None].to(grad.dtype), None, None, None, None, None


def head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [R] fp32, argmax [R]) of the LM head on hidden [R, H], without all logits at once.

    `fused`: each chunk through the compiled `_ce_chunk` (the trainer turns it on for CUDA when
    compiling is allowed). Inside an enclosing `torch.compile` (a compiled whole step) the
    out-of-place chunk is traced into that graph instead, which Inductor fuses the same way."""
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    if torch.compiler.is_compiling():
        mode = "traced"
    else:
        mode = "compiled" if fused else "eager"
    return ChunkedHeadCE.apply(hidden, weight, labels, chunk_rows, need_grad, mode)


@dataclass
class LossOutput:
    """The differentiable loss plus detached metrics of one forward pass."""

    loss: torch.Tensor  # scalar fp32, weighted mean CE
    acceptance_length: torch.Tensor  # scalar fp32, mean over valid blocks
    num_blocks: torch.Tensor  # scalar long, valid blocks


def dflash_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    anchor_valid: torch.Tensor,
    gamma: float,
    chunk_rows: int,
    fused: bool = False,
) -> LossOutput:
    """Decayed CE over block positions 1..B-1 normalised by the weight sum, and acceptance length.

    hidden: [N, A, B-1, H] drafter outputs; labels / label_mask: [N, A, B-1]; anchor_valid: [N, A].
    `fused`: see `head_cross_entropy`.
    """
    n, a, k, h = hidden.shape
    ce, pred = head_cross_entropy(hidden.reshape(-1, h), head_weight, labels.reshape(-1), chunk_rows, fused)
    ce, pred = ce.view(n, a, k), pred.view(n, a, k)
    weights = position_weights(k + 1, gamma, hidden.device) * label_mask  # [N, A, B-1]
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
    # Teacher-forced acceptance: 1 (the anchor/bonus token) + leading run of correct drafts.
    run = (pred == labels).long().cumprod(-1).sum(-1)  # [N, A]
    valid = anchor_valid.float()
    num_blocks = anchor_valid.sum()
    acceptance = ((1 + run).float() * valid).sum() / valid.sum().clamp_min(1.0)
    return LossOutput(loss, acceptance.detach(), num_blocks)
