"""The drafter's FlexAttention in its key order and with or without row guards (CUDA; run from
the repo root)

    python3 bench/flex_order.py

The kernel starts each row's running max at -inf over the first key tile it visits; unguarded
(ROWS_GUARANTEED_SAFE), a row that sees nothing there becomes NaN. The trainer's keys are
[blocks; context], guarded; the old layout was [context; blocks]. With the blocks first and the
forward key tile as wide as the mask's (128), the first tile a query tile visits holds its own
blocks, which every row sees, so dropping the guards would be safe. This compares, at the 8B
preset's shape (32/8 heads of 128, 3072 context, 512 anchors of 16), forward+backward time and
whether every output and gradient is finite and matches dense fp32 attention
(gpu_smoke.attention_error) for gpu_smoke.flex_anchors' three patterns.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "remote_payload"), str(ROOT / "tests" / "payload")]

from dflash_train.model import attend, dense_block_mask, flex_block_mask  # noqa: E402
from gpu_smoke import attention_error, flex_anchors  # noqa: E402

CTX, ANCHORS, BS = 3072, 512, 16
Q = ANCHORS * BS
SHAPES = ((1, 32, Q, 128), (1, 8, Q + CTX, 128), (1, 8, Q + CTX, 128))  # q, k, v at the 8B preset
UNGUARDED = {"ROWS_GUARANTEED_SAFE": True}
VARIANTS = {
    # name: (the old [context; blocks] layout?, kernel options)
    "trainer: blocks first, guarded": (False, None),
    "blocks first, unguarded, key tile 128": (False, {**UNGUARDED, "fwd_BLOCK_N": 128, "fwd_num_stages": 2}),
    "blocks first, unguarded, default key tile (unsafe)": (False, UNGUARDED),
    "old: context first, guarded": (True, None),
    "old: context first, unguarded (unsafe, runs 35-39)": (True, UNGUARDED),
}
COMPILED = torch.compile(flex_attention, dynamic=False)


def context_first_mask(anchors):
    """The old layout's block mask, keys [context; blocks] (the same attention)."""

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // BS
        in_ctx = kv_idx < CTX
        return (in_ctx & (kv_idx < anchors[b, blk])) | (~in_ctx & ((kv_idx - CTX) // BS == blk))

    return create_block_mask(mask_mod, anchors.shape[0], None, Q, CTX + Q, device=anchors.device)


def context_first(t):
    """Keys [blocks; context] -> [context; blocks]."""
    return torch.cat([t[:, :, Q:], t[:, :, :Q]], dim=2)


def variant_flex(variant, anchors):
    """The variant's FlexAttention as model.attend calls it, on keys in the trainer's order."""
    old, options = VARIANTS[variant]
    if not old:
        return lambda *args, **kwargs: COMPILED(*args, kernel_options=options, **kwargs)
    mask = context_first_mask(anchors)  # attend's (trainer-order) mask is replaced with the old one
    return lambda q, k, v, block_mask, **kwargs: COMPILED(
        q, context_first(k), context_first(v), block_mask=mask, kernel_options=options, **kwargs
    )


def reference(pattern):
    """Anchors, inputs and dense fp32 attention's output and gradients (one kv head's group at a time)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    anchors = flex_anchors(pattern, 1, ANCHORS, CTX, g)
    q, k, v = (torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in SHAPES)
    mask = dense_block_mask(anchors, CTX, BS)
    group = SHAPES[0][1] // SHAPES[1][1]
    outs, grads = [], [[], [], []]
    for h in range(SHAPES[1][1]):
        ref = [
            t.detach().float().requires_grad_()
            for t in (q[:, group * h : group * (h + 1)], k[:, h : h + 1], v[:, h : h + 1])
        ]
        out = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=True)
        out.mul(out.detach().sign()).sum().backward()
        outs.append(out.detach())
        for acc, t in zip(grads, ref):
            acc.append(t.grad)
    return anchors, (q, k, v), torch.cat(outs, 1), [torch.cat(x, 1) for x in grads]


def check(variant, anchors, inputs, ref_out, ref_grads):
    """Finite and close to dense fp32 (gpu_smoke.attention_error's verdict)."""
    flex = variant_flex(variant, anchors)
    return attention_error(flex, flex_block_mask(anchors, CTX, BS), *inputs, ref_out, ref_grads)


def time_ms(variant, iters=20):
    """Forward+backward ms at the 8B shape (32/8 heads), random anchors."""
    anchors = flex_anchors("random", 1, ANCHORS, CTX, torch.Generator(device="cuda").manual_seed(0))
    flex, mask = variant_flex(variant, anchors), flex_block_mask(anchors, CTX, BS)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_() for s in SHAPES)
    for _ in range(3):
        attend(q, k, v, mask, flex).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        attend(q, k, v, mask, flex).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


if __name__ == "__main__":
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    torch._dynamo.config.cache_size_limit = 64
    print("| variant | fwd+bwd ms | random | padded | every6 |\n| --- | ---: | --- | --- | --- |", flush=True)
    refs = [reference(p) for p in ("random", "padded", "every6")]
    for name in VARIANTS:
        try:
            verdicts = [check(name, *ref) for ref in refs]
            ms = f"{time_ms(name):.2f}"
        except Exception as exc:  # a config the kernel refuses: say so and go on
            verdicts, ms = [f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"] * 3, "-"
        print(f"| {name} | {ms} | {' | '.join(verdicts)} |", flush=True)
