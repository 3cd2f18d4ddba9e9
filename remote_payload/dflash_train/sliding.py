"""Sliding-window drafter layers (`drafter.layer_types`, `drafter.sliding_window`), as z-lab's
newer drafters publish them (`layer_types: sliding_attention` with `sliding_window` in config.json).

In a sliding layer a block token at position p sees the context positions k with p - k < W (and
k before its anchor, as every layer), the transformers convention (`kv_idx > q_idx - W`); its own
block stays fully visible. Full layers keep the plain block mask (model.py). A drafter with both
kinds gets one mask per kind, `{layer type: mask}`, which `DFlashDrafter.forward` picks from per
layer; a drafter of full layers only gets the plain mask as before.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .model import DrafterSpec, block_mask, dense_block_mask
from .resolve import FULL, SLIDING


def dense_sliding_mask(anchors: torch.Tensor, seq_len: int, block_size: int, window: int) -> torch.Tensor:
    """`dense_block_mask` with the context cut to the last `window` positions before each query:
    [N, 1, Q, Q+S] (True = attend)."""
    mask = dense_block_mask(anchors, seq_len, block_size)
    q = anchors.shape[1] * block_size
    offsets = torch.arange(q, device=anchors.device) % block_size  # [Q] position in the block
    q_pos = anchors[:, torch.arange(q, device=anchors.device) // block_size] + offsets  # [N, Q]
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    near = (q_pos[:, :, None] - ctx_pos[None, None, :]) < window  # [N, Q, S]
    keep = torch.cat([torch.ones(*near.shape[:2], q, dtype=torch.bool, device=anchors.device), near], -1)
    return mask & keep[:, None]


def flex_sliding_mask(anchors: torch.Tensor, seq_len: int, block_size: int, window: int) -> BlockMask:
    """The same mask as `dense_sliding_mask`, as a FlexAttention BlockMask (CUDA)."""
    n, a = anchors.shape
    q = a * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        q_pos = anchors[b, blk] + q_idx % block_size
        in_block = kv_idx < q
        sees_block = in_block & (kv_idx // block_size == blk)
        ctx_pos = kv_idx - q
        sees_ctx = ~in_block & (ctx_pos < anchors[b, blk]) & (q_pos - ctx_pos < window)
        return sees_block | sees_ctx

    return create_block_mask(mask_mod, n, None, q, q + seq_len, device=anchors.device)


def drafter_masks(anchors: torch.Tensor, seq_len: int, spec: DrafterSpec, backend: str):
    """The training mask(s) for a batch: `model.block_mask` for a drafter of full layers, else
    {layer type: mask} for `DFlashDrafter.forward` to pick from per layer."""
    full = block_mask(anchors, seq_len, spec.block_size, backend)
    if SLIDING not in spec.layer_types:
        return full
    make = flex_sliding_mask if backend == "flex" else dense_sliding_mask
    return {FULL: full, SLIDING: make(anchors, seq_len, spec.block_size, spec.sliding_window)}


def draft_masks(spec: DrafterSpec, start: torch.Tensor, slots: int) -> dict[str, torch.Tensor]:
    """The decode masks [1, 1, B, slots] of a block at positions start..start+B-1 over a cache of
    `slots` slots: {layer type: mask}; a sliding layer sees the context within its window."""
    keys = torch.arange(slots, device=start.device)
    q_pos = start + torch.arange(spec.block_size, device=start.device)  # [B]
    seen = (keys < start + spec.block_size).expand(spec.block_size, slots)  # context + the block
    masks = {FULL: seen[None, None]}
    if SLIDING in spec.layer_types:
        near = (keys[None] >= start) | (q_pos[:, None] - keys[None] < spec.sliding_window)
        masks[SLIDING] = (seen & near)[None, None]
    return masks
