"""The fast path (fused chunked LM head + CE, regionally compiled draft and target layers) against a
plain reference implementation, on CPU.

Reference: the eager drafter with the dense mask, full logits `hidden @ W.T` in float64 and
`F.cross_entropy`, the decayed weights applied by hand. Tolerances (relative, ||fast - ref|| / ||ref||):

- fp32 (everything here): 1e-5 for the loss, 1e-4 for every gradient. Measured here: 7.8e-8 for
  the loss, 2.4e-6 for the worst gradient; the margin covers other CPUs' BLAS blocking.
- bf16 (LM head weight and hidden in bf16, as on the GPU): 2e-2. One bf16 rounding of logits and of
  the softmax is ~4e-3 relative; measured here 3.3e-4 (CE) and 2.1e-3 (its gradient).

Inductor compiles C++ on CPU, so this checks the graphs Dynamo captures and the math Inductor
fuses, not the Triton kernels; `bench/step_bench.py` compares the fast and the trainer-default
paths' losses on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.loss import _ce_chunk, _ce_chunk_inplace, dflash_loss, position_weights
from dflash_train.model import DFlashDrafter, DrafterSpec, Shape, block_input_ids, dense_block_mask
from dflash_train.target import build_random_target
from dflash_train.config import TargetConfig

LOSS_TOL, GRAD_TOL, BF16_TOL = 1e-5, 1e-4, 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def reference_ce(hidden, weight, labels):
    """Full float64 logits and F.cross_entropy: (ce, argmax, d sum(ce) / d hidden)."""
    h = hidden.detach().double().requires_grad_(True)
    logits = h @ weight.double().T
    ce = F.cross_entropy(logits, labels, reduction="none")
    ce.sum().backward()
    return ce.detach(), logits.argmax(-1), h.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16_TOL)])
def test_fused_chunk_math_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(24, 32, generator=g).to(dtype)
    weight = (torch.randn(301, 32, generator=g) / 4).to(dtype)
    labels = torch.randint(0, 301, (24,), generator=g)
    ce, pred, grad = _ce_chunk(hidden, weight, labels, True)
    ce2, pred2, grad2 = _ce_chunk_inplace(hidden, weight, labels, True)
    # The out-of-place (compilable) form is the in-place eager form, bit for bit.
    assert torch.equal(ce, ce2) and torch.equal(pred, pred2) and torch.equal(grad, grad2)
    ref_ce, ref_pred, ref_grad = reference_ce(hidden, weight, labels)
    assert rel(ce, ref_ce) < tol and rel(grad, ref_grad) < tol
    if dtype == torch.float32:
        assert torch.equal(pred, ref_pred)
    assert _ce_chunk(hidden, weight, labels, False)[2] is None


def small_problem(seed=0):
    """A small drafter (2 layers, block 4) over a random 3-layer target's features, fp32."""
    tcfg = TargetConfig(
        num_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=97,
        init_std=0.1,
    )
    target = build_random_target(tcfg, seed)
    shape = Shape(32, 64, 4, 2, 8, 1e-6, 10000.0)
    spec = DrafterSpec(shape, num_layers=2, block_size=4, target_layer_ids=(0, 2), mask_token_id=96)
    g = torch.Generator().manual_seed(seed + 1)
    n, s = 2, 24
    ids = torch.randint(0, 96, (n, s), generator=g)
    anchors = torch.stack([torch.randperm(s - 4, generator=g)[:5].sort().values for _ in range(n)])
    return target, spec, ids, anchors


def run(drafter, target, spec, ids, anchors, fused, chunk_rows=7, reference=False):
    """Loss and grads of one batch; `reference` uses full float64 logits and F.cross_entropy."""
    drafter.zero_grad(set_to_none=True)
    n, s = ids.shape
    bs = spec.block_size
    feats = target.features(ids, spec.target_layer_ids)
    embeds = target.embed_tokens(block_input_ids(ids, anchors, bs, spec.mask_token_id))
    hidden = drafter(feats, embeds, anchors, dense_block_mask(anchors, s, bs))
    a = anchors.shape[1]
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:]
    label_pos = (anchors[:, :, None] + torch.arange(1, bs)).flatten(1)
    labels = ids.gather(1, label_pos).view(n, a, bs - 1)
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    if reference:
        logits = hidden.double() @ target.lm_head.weight.double().T
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(n, a, bs - 1)
        w = position_weights(bs, 3.0).double() * label_mask
        loss = (ce * w).sum() / w.sum()
    else:
        loss = dflash_loss(
            hidden,
            target.lm_head.weight,
            labels,
            label_mask,
            torch.ones(n, a, dtype=torch.bool),
            3.0,
            chunk_rows,
            fused,
        ).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()}


def test_fast_path_loss_and_grads_match_plain_reference():
    """Compiled draft layers + compiled target layers + fused chunked CE vs the eager drafter with
    full-logit float64 cross-entropy: same loss and gradients (fp32, CPU)."""
    target, spec, ids, anchors = small_problem()
    ref_drafter = DFlashDrafter(spec)
    ref_drafter.init_weights(0.2, 5)
    ref_loss, ref_grads = run(ref_drafter, target, spec, ids, anchors, fused=False, reference=True)

    # The eager chunked path first (what the golden file pins).
    eager_loss, eager_grads = run(ref_drafter, target, spec, ids, anchors, fused=False)
    assert rel(eager_loss, ref_loss) < LOSS_TOL
    assert max(rel(eager_grads[k], ref_grads[k]) for k in ref_grads) < GRAD_TOL

    fast_target = build_random_target(target.cfg, 0).compile_layers(dynamic=False)
    fast = DFlashDrafter(spec)
    fast.load_state_dict(ref_drafter.state_dict())
    fast.compile_layers(dynamic=False)
    assert list(fast.state_dict()) == list(ref_drafter.state_dict())  # export names unchanged
    fast_loss, fast_grads = run(fast, fast_target, spec, ids, anchors, fused=True)
    assert rel(fast_loss, ref_loss) < LOSS_TOL, (fast_loss, ref_loss)
    worst = max(rel(fast_grads[k], ref_grads[k]) for k in ref_grads)
    assert worst < GRAD_TOL, worst
    assert all(fast_grads[k].abs().sum() > 0 for k in fast_grads)  # every parameter got a gradient
