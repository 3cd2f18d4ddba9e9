"""Qwen3 building blocks and the DFlash drafter (arXiv 2602.06036), in one readable file.

Notation for tensor shapes in comments:
    N  sequences in the batch          S  context (sequence) length
    A  anchors (blocks) per sequence   B  block size        Q = A*B block tokens
    H  hidden size    L  target feature layers    nh / nkv  query / key-value heads    d  head_dim

Training layout (one forward pass trains all A blocks of every sequence):
    keys/values = [blocks (Q) ; context (S)]     queries = blocks (Q) only
A block anchored at position a holds [token a, MASK x (B-1)] at positions a..a+B-1; it attends to
the context strictly before a and bidirectionally to its own B tokens, never to other blocks.
The blocks' keys come first: the same attention (it does not depend on the keys' order), and
FlexAttention's forward and backward at the 8B shape take 3.28 ms instead of 3.54 ms
(bench/flex_order.py, H200, 2026-12-06).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def to_empty(module: nn.Module, device: str | torch.device) -> nn.Module:
    """`module.to_empty(device=device)`: uninitialised storage of each tensor's shape and dtype,
    without the meta device's empty_like (a Python reference that imports sympy, ~0.5 s of CPU
    per process)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


@dataclass(frozen=True)
class Shape:
    """Width of one Qwen3 decoder layer (shared by target and drafter)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the target's rope scaling; () for plain rope


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple = (), device=None) -> torch.Tensor:
    """The rotation frequencies [d/2]: theta^(-2i/d), rescaled as the target's rope scaling says
    (`linear`: all divided by `factor`; `llama3`: long wavelengths divided by `factor`, short ones
    kept, a linear blend between the two cut-offs)."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [d/2]
    params = dict(scaling)
    kind = params.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, old_context = params["factor"], params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        # In units of the original context: how many turns a frequency makes over it.
        turns = old_context * inv_freq / (2 * math.pi)
        blend = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: slow (scaled), 1: fast (kept)
        return inv_freq / factor * (1 - blend) + inv_freq * blend
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not implemented for the drafter")
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: tuple = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions [..., T] -> two [..., T, d] tensors (HF Qwen3 layout)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)  # [d/2]
    freqs = positions.float()[..., None] * inv_freq  # [..., T, d/2], fp32 so large positions stay exact
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, T, d] by cos/sin [N or 1, T, d] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, T, d]: broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Qwen3 attention projections: GQA, per-head q_norm/k_norm before RoPE, no biases."""

    def __init__(self, shape: Shape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, H] -> normed queries [N, nh, T, d] (before RoPE)."""
        n, t, _ = x.shape
        return self.q_norm(self.q_proj(x).view(n, t, self.num_heads, self.head_dim)).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> normed keys, values [N, nkv, T, d] (keys before RoPE)."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, nh, T, d] -> [N, T, H]."""
        n, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(n, t, self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> normed queries [N, nh, T, d], normed keys and values [N, nkv, T, d] (before RoPE)."""
        return (self.queries(x), *self.keys_values(x))

    def causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention (the target's): x [N, S, H], cos/sin [1, S, d] -> [N, S, H]."""
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.output(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; `forward` is the target's causal layer. The target passes
    its own attention and MLP classes (target.py: fused projections, same math)."""

    def __init__(self, shape: Shape, attention: type[nn.Module] = Attention, mlp: type[nn.Module] = MLP):
        super().__init__()
        self.self_attn = attention(shape)
        self.mlp = mlp(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, S, H] -> [N, S, H]
        x = x + self.self_attn.causal(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------
# Block attention mask: built once per batch, shared by every draft layer.


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute positions of the block tokens: anchors [N, A] -> [N, A*B] (token k of block a: a+k)."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def dense_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [N, 1, Q, Q+S] (True = attend) for SDPA: own block, context < anchor."""
    n, a = anchors.shape
    q = a * block_size
    q_block = torch.arange(q, device=anchors.device) // block_size  # [Q] block index of each query
    q_anchor = anchors[:, q_block]  # [N, Q]
    ctx_pos = torch.arange(seq_len, device=anchors.device)  # [S]
    sees_ctx = ctx_pos[None, None, :] < q_anchor[:, :, None]  # [N, Q, S]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(n, q, q)  # [N, Q, Q]
    return torch.cat([sees_block, sees_ctx], dim=-1)[:, None]  # [N, 1, Q, Q+S]


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> BlockMask:
    """The same mask as `dense_block_mask`, as a FlexAttention BlockMask."""
    n, a = anchors.shape
    q = a * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        in_block = kv_idx < q
        sees_block = in_block & (kv_idx // block_size == blk)
        sees_ctx = ~in_block & (kv_idx - q < anchors[b, blk])
        return sees_block | sees_ctx

    return create_block_mask(mask_mod, n, None, q, q + seq_len, device=anchors.device)


def block_mask(anchors: torch.Tensor, seq_len: int, block_size: int, backend: str) -> torch.Tensor | BlockMask:
    """The mask for `backend` ('flex' or 'dense')."""
    if backend == "flex":
        return flex_block_mask(anchors, seq_len, block_size)
    return dense_block_mask(anchors, seq_len, block_size)


# FlexAttention keeps its row guards (ROWS_GUARANTEED_SAFE unset). The kernel starts each row's
# running max at -inf over the first key tile it visits, and unguarded, a row that sees no key
# there becomes NaN though it sees keys later (padding anchors at 0 did, run 39). In this layout,
# with the forward key tile widened to the mask's 128, every row would see its own block there,
# but the guards cost nothing measurable at the 8B shape (flex_order.py; a step of 216.5 ms
# unguarded and 216.3 ms guarded in step_bench.py, H200, 2026-12-06), so they stay.


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask, flex_fn=flex_attention
) -> torch.Tensor:
    """q [N, nh, Q, d], k/v [N, nkv, Q+S, d] under a dense or block mask -> [N, nh, Q, d]."""
    # Under autocast the fp32 norm weights promote q/k to fp32 while v stays bf16; SDPA would
    # recast all three, FlexAttention wants them equal: use v's (the compute) dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    if isinstance(mask, BlockMask):
        return flex_fn(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# ----------------------------------------------------------------------------------------------
# The drafter.


@dataclass(frozen=True)
class DrafterSpec:
    """Everything that fixes the drafter's parameters and math (exported as config.json)."""

    shape: Shape
    num_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...] = ()  # per layer full_attention | sliding_attention; () = all full
    sliding_window: int | None = None  # the sliding layers' window (sliding.py)

    def layer_type(self, i: int) -> str:
        """Layer i's attention: full_attention or sliding_attention."""
        return self.layer_types[i] if self.layer_types else "full_attention"


class DraftLayer(DecoderLayer):
    """Decoder layer with KV injection: block queries attend to [k_proj(block); k_proj(ctx)]."""

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask,
        flex_fn=flex_attention,
    ) -> torch.Tensor:
        # x: [N, Q, H] block stream; ctx: [N, S, H] fused target features (not normed again, no MLP,
        # no residual: the context only supplies keys and values); cos/sin: [N, Q+S, d]
        q_len = x.shape[1]
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = apply_rope(attn.queries(h), cos[:, :q_len], sin[:, :q_len])  # [N, nh, Q, d]
        k_blk, v_blk = attn.keys_values(h)  # [N, nkv, Q, d]
        k_ctx, v_ctx = attn.keys_values(ctx)  # [N, nkv, S, d]
        k = apply_rope(torch.cat([k_blk, k_ctx], dim=2), cos, sin)  # [N, nkv, Q+S, d]
        v = torch.cat([v_blk, v_ctx], dim=2)  # [N, nkv, Q+S, d]
        x = x + attn.output(attend(q, k, v, mask, flex_fn))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The trainable drafter; parameter names match the published z-lab DFlash checkpoints.

    The embedding and LM head are the target's (frozen, shared) and deliberately not submodules,
    so `state_dict()` is exactly the exported tensor set.
    """

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        h, eps = spec.shape.hidden_size, spec.shape.rms_norm_eps
        self.layers = nn.ModuleList(DraftLayer(spec.shape) for _ in range(spec.num_layers))
        self.norm = RMSNorm(h, eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.on_layer: Callable[[int, int], None] | None = None  # (i, n) before layer i: progress probe

    @torch.no_grad()
    def init_weights(self, std: float, seed: int, threads: int | None = None) -> None:
        """Normal(0, std) linear weights and unit norms, in place on the CPU.

        Weight i is drawn from a CPU generator of its own, seeded from (seed, i): the values are
        the same on every machine and for any number of drawing threads, and the weights are
        drawn in parallel (one thread draws ~100M values a second: an 8B-scale drafter's 1.05B
        took ~10 s in one thread). Every parameter is a linear weight or a norm scale."""
        weights = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        scales = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        if {id(p) for p in weights + scales} != {id(p) for p in self.parameters()}:
            raise RuntimeError("init_weights: a parameter is neither a linear weight nor a norm scale")
        if any(p.device.type != "cpu" for p in weights):
            raise ValueError("init_weights draws on the CPU (identical everywhere): move the drafter there first")

        def draw(index: int) -> None:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            with torch.no_grad():  # grad mode is per thread
                weights[index].normal_(0.0, std, generator=gen)  # releases the GIL: threads draw at once

        workers = threads or max(1, min(len(weights), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw, range(len(weights))))
        for scale in scales:
            scale.fill_(1.0)

    def compile_layers(self, **compile_kwargs) -> "DFlashDrafter":
        """Regional compilation: `torch.compile` each draft layer in place (`Module.compile`).

        All layers run the same code with their parameters as graph inputs, so Dynamo traces and
        Inductor compiles one layer (forward and backward) and the others reuse it: compile time is
        about one layer's instead of the whole drafter's, and each layer's norms, RoPE, SwiGLU and
        FlexAttention (its own Triton kernel, with the batch's BlockMask as an input) are fused.
        Parameter names and `state_dict()` are unchanged (no `_orig_mod.` prefix), so export and
        checkpoints do not notice. `compile_kwargs` go to `torch.compile` (e.g. `dynamic=False`,
        `options=` from `plan.choose_compile_policy`).
        """
        for layer in self.layers:
            layer.compile(**compile_kwargs)
        return self

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        mask,
        flex_fn=flex_attention,
    ) -> torch.Tensor:
        """Hidden states of all block tokens after the final norm: [N, Q, H]. `mask`: one block
        mask for every layer, or {layer type: mask} (sliding.drafter_masks)."""
        # target_hidden: [N, S, L*H]; block_embeds: [N, Q, H]; anchors: [N, A]
        n, s, _ = target_hidden.shape
        ctx = self.hidden_norm(self.fc(target_hidden))  # [N, S, H]
        ctx_pos = torch.arange(s, device=anchors.device).expand(n, s)  # [N, S]
        positions = torch.cat([block_positions(anchors, self.spec.block_size), ctx_pos], 1)  # [N, Q+S]
        shape = self.spec.shape
        cos, sin = rope_cos_sin(
            positions, shape.head_dim, shape.rope_theta, ctx.dtype, shape.rope_scaling
        )  # [N, Q+S, d]
        x = block_embeds.to(ctx.dtype)
        for i, layer in enumerate(self.layers):
            if self.on_layer is not None:
                self.on_layer(i, len(self.layers))
            layer_mask = mask[self.spec.layer_type(i)] if isinstance(mask, dict) else mask
            x = layer(x, ctx, cos, sin, layer_mask, flex_fn)
        return self.norm(x)


def block_input_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """Block token ids [N, A*B]: the anchor's token, then MASK x (B-1)."""
    n, a = anchors.shape
    ids = torch.full((n, a, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.flatten(1)
