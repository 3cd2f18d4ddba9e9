"""Drafter math: block mask vs brute force, flex vs dense, RoPE positions, KV injection."""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.model import (
    DFlashDrafter,
    DrafterSpec,
    Shape,
    apply_rope,
    block_mask,
    block_positions,
    dense_block_mask,
    flex_block_mask,
    attend,
    rope_cos_sin,
)
from dflash_train.sliding import dense_sliding_mask

# Eager FlexAttention on CPU is the unfused reference path: exactly what these checks want.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SHAPE = Shape(
    hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0
)


def make_drafter(block_size=4, layers=2, seed=0):
    spec = DrafterSpec(SHAPE, layers, block_size, (1, 3), mask_token_id=0)
    drafter = DFlashDrafter(spec)
    drafter.init_weights(0.2, seed)
    return drafter


def test_dense_mask_matches_brute_force():
    anchors = torch.tensor([[0, 3, 9], [2, 5, 6]])
    seq_len, bs = 12, 4
    mask = dense_block_mask(anchors, seq_len, bs)
    n, a = anchors.shape
    q = a * bs
    assert mask.shape == (n, 1, q, q + seq_len)
    for b in range(n):
        for qi in range(q):
            blk = qi // bs
            for kv in range(q + seq_len):
                if kv < q:
                    expected = kv // bs == blk  # own block, bidirectional
                else:
                    expected = kv - q < anchors[b, blk].item()  # context strictly before the anchor
                assert mask[b, 0, qi, kv].item() == expected, (b, qi, kv)


def test_flex_and_dense_attention_agree():
    torch.manual_seed(0)
    anchors = torch.tensor([[1, 4, 10], [0, 7, 8]])
    seq_len, bs = 16, 4
    q = torch.randn(2, 4, 12, 8)
    k = torch.randn(2, 2, 12 + seq_len, 8)
    v = torch.randn(2, 2, 12 + seq_len, 8)
    dense = attend(q, k, v, dense_block_mask(anchors, seq_len, bs))
    flex = attend(q, k, v, flex_block_mask(anchors, seq_len, bs))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_block_positions_are_anchor_plus_offset():
    anchors = torch.tensor([[3, 10]])
    assert block_positions(anchors, 4).tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]


def test_rope_rotates_pairs_by_position_times_frequency():
    x = torch.randn(1, 1, 3, 8)
    positions = torch.tensor([[0, 5, 17]])
    cos, sin = rope_cos_sin(positions, 8, 10000.0, torch.float32)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])  # position 0 is the identity
    for t, pos in enumerate(positions[0].tolist()):
        for i in range(4):  # pair (i, i + d/2) rotates by pos * theta^(-2i/d)
            angle = torch.tensor(pos * 10000.0 ** (-2 * i / 8))
            a, b = x[0, 0, t, i], x[0, 0, t, i + 4]
            torch.testing.assert_close(out[0, 0, t, i], a * angle.cos() - b * angle.sin())
            torch.testing.assert_close(out[0, 0, t, i + 4], a * angle.sin() + b * angle.cos())


def naive_drafter(drafter, target_hidden, block_embeds, anchors):
    """The spec written out per block: keys = [ctx[:a] at 0..a-1 ; own block at a..a+B-1]."""
    bs = drafter.spec.block_size
    ctx = drafter.hidden_norm(drafter.fc(target_hidden))
    outs = []
    for b in range(anchors.shape[0]):
        per_block = []
        for j, a in enumerate(anchors[b].tolist()):
            x = block_embeds[b : b + 1, j * bs : (j + 1) * bs]
            c = ctx[b : b + 1, :a]
            cos_q, sin_q = rope_cos_sin(torch.arange(a, a + bs)[None], 8, 10000.0, x.dtype)
            cos_k, sin_k = rope_cos_sin(torch.arange(0, a + bs)[None], 8, 10000.0, x.dtype)
            for layer in drafter.layers:
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = apply_rope(attn.queries(h), cos_q, sin_q)
                kc, vc = attn.keys_values(c)
                kb, vb = attn.keys_values(h)
                k = apply_rope(torch.cat([kc, kb], 2), cos_k, sin_k)
                v = torch.cat([vc, vb], 2)
                o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # no mask at all
                x = x + attn.output(o)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            per_block.append(drafter.norm(x))
        outs.append(torch.cat(per_block, 1))
    return torch.cat(outs, 0)


def test_batched_drafter_matches_per_block_reference():
    torch.manual_seed(1)
    drafter = make_drafter()
    anchors = torch.tensor([[2, 5, 11], [1, 6, 9]])
    seq_len = 16
    target_hidden = torch.randn(2, seq_len, 2 * 32)
    embeds = torch.randn(2, 12, 32)
    expected = naive_drafter(drafter, target_hidden, embeds, anchors)
    for backend in ("dense", "flex"):
        with torch.no_grad():  # FlexAttention has no CPU backward; its CUDA path is what trains
            out = drafter(target_hidden, embeds, anchors, block_mask(anchors, seq_len, 4, backend))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_block_ignores_later_context_and_other_blocks():
    torch.manual_seed(2)
    drafter = make_drafter()
    anchors = torch.tensor([[4, 9]])
    seq_len = 14
    target_hidden = torch.randn(1, seq_len, 64)
    embeds = torch.randn(1, 8, 32)
    mask = dense_block_mask(anchors, seq_len, 4)
    base = drafter(target_hidden, embeds, anchors, mask)
    changed = target_hidden.clone()
    changed[:, 4:] += 1.0  # context at/after the first anchor
    other = embeds.clone()
    other[:, 4:] += 1.0  # the second block's tokens
    torch.testing.assert_close(drafter(changed, other, anchors, mask)[:, :4], base[:, :4])
    # ...while the context before the anchor does matter.
    earlier = target_hidden.clone()
    earlier[:, 3] += 1.0
    assert not torch.allclose(drafter(earlier, embeds, anchors, mask)[:, :4], base[:, :4])


def test_parameter_names_match_published_layout():
    names = set(make_drafter(layers=1).state_dict())
    attn = {f"layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    mlp = {f"layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    norms = {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}
    assert names == attn | mlp | norms | {"norm.weight", "fc.weight", "hidden_norm.weight"}


def test_no_query_row_of_a_training_mask_is_fully_masked():
    """Every block query sees a key (its own block), in the full mask and the sliding one, an anchor
    at 0 and a window of one position included: no row of the attention is all masked."""
    anchors = torch.tensor([[0, 1, 7, 20], [3, 3, 12, 19]])
    seq_len, bs = 24, 4
    masks = [dense_block_mask(anchors, seq_len, bs)] + [
        dense_sliding_mask(anchors, seq_len, bs, window) for window in (1, 2, 5)
    ]
    for mask in masks:
        assert mask.any(-1).all()
