"""DFlash loss: position-decayed cross-entropy through the frozen LM head, computed in row chunks,
and the teacher-forced acceptance length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

def default_gamma(block_size: int) -> float:
    """gamma for w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16, interpolated otherwise."""
    # The paper's three points (App. A.1) joined linearly: slope 1/2 below B=10, 1/3 above, floor 1.
    if block_size <= 10:
        return max(1.0, 5.0 + (block_size - 10) / 2)
    return 5.0 + (block_size - 10) / 3


def position_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1: [B-1] fp32."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


class ChunkedHeadCE(torch.autograd.Function):
    """Per-row cross-entropy and argmax of `hidden @ weight.T`, `chunk_rows` rows at a time.

    Only one chunk of fp32 logits [chunk_rows, V] exists at once: the gradient w.r.t. `hidden`
    ((softmax - onehot) @ weight, [R, H]) is computed in the same pass and kept instead of the
    logits. `weight` is the frozen LM head and gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows: int, need_grad: bool):
        # hidden: [R, H]; weight: [V, H]; labels: [R] -> ce [R] fp32, argmax [R] long
        rows = hidden.shape[0]
        ce = hidden.new_empty(rows, dtype=torch.float32)
        pred = labels.new_empty(rows)
        grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            logits = (hidden[start:end].to(weight.dtype) @ weight.T).float()        # [r, V]
            lse = logits.logsumexp(-1)                                              # [r]
            target_logit = logits.gather(1, labels[start:end, None])[:, 0]
            ce[start:end] = lse - target_logit
            pred[start:end] = logits.argmax(-1)
            if need_grad:
                probs = logits.sub_(lse[:, None]).exp_()                            # softmax, in place
                probs[torch.arange(end - start, device=probs.device), labels[start:end]] -= 1.0
                grad[start:end] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.mark_non_differentiable(pred)
        if need_grad:
            ctx.save_for_backward(grad)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce[:, None].to(grad.dtype), None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [R] fp32, argmax [R]) of the LM head on hidden [R, H], without all logits at once."""
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return ChunkedHeadCE.apply(hidden, weight, labels, chunk_rows, need_grad)


@dataclass
class LossOutput:
    """The differentiable loss plus detached metrics of one forward pass."""

    loss: torch.Tensor               # scalar fp32, weighted mean CE
    acceptance_length: torch.Tensor  # scalar fp32, mean over valid blocks
    num_blocks: torch.Tensor         # scalar long, valid blocks


def dflash_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                label_mask: torch.Tensor, anchor_valid: torch.Tensor, gamma: float,
                chunk_rows: int) -> LossOutput:
    """Decayed CE over block positions 1..B-1 normalised by the weight sum, and acceptance length.

    hidden: [N, A, B-1, H] drafter outputs; labels / label_mask: [N, A, B-1]; anchor_valid: [N, A].
    """
    n, a, k, h = hidden.shape
    ce, pred = head_cross_entropy(hidden.reshape(-1, h), head_weight, labels.reshape(-1), chunk_rows)
    ce, pred = ce.view(n, a, k), pred.view(n, a, k)
    weights = position_weights(k + 1, gamma, hidden.device) * label_mask                  # [N, A, B-1]
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
    # Teacher-forced acceptance: 1 (the anchor/bonus token) + leading run of correct drafts.
    run = (pred == labels).long().cumprod(-1).sum(-1)                                     # [N, A]
    valid = anchor_valid.float()
    num_blocks = anchor_valid.sum()
    acceptance = ((1 + run).float() * valid).sum() / valid.sum().clamp_min(1.0)
    return LossOutput(loss, acceptance.detach(), num_blocks)
