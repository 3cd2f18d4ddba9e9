"""The hand-written target's fused projections (issue 31): one q/k/v weight and one gate/up weight
per layer, built from a checkpoint's separate HF tensors, compute what transformers' own
Qwen3ForCausalLM computes from that checkpoint, in fp32 on the CPU: the causal forward's logits
and features, and the KV-cached decoder's prefill, single-token and multi-token (verify) steps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_target_hf import VOCAB, save_tiny  # noqa: E402

from dflash_train.decode import Decoder  # noqa: E402
from dflash_train.target import hf_state_dict, load_hf_target  # noqa: E402

FEATURE_LAYERS = (0, 2)  # of 4: hidden_states[4] is after the final norm, not a layer's output
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 rounding: the fused GEMM sums in another order than three


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our fused target, transformers' model) from one tiny random Qwen3 checkpoint."""
    path = tmp_path_factory.mktemp("qwen3")
    model = save_tiny(path, "qwen3")
    return load_hf_target(path, [], dtype=torch.float32, whole=True), model


def reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits [N, S, V] and the feature layers' hidden states [N, S, L*H]."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i + 1] for i in FEATURE_LAYERS], -1)


def test_fused_weights_are_the_checkpoints_rows(pair):
    """No separate projection is kept, and splitting the fused weights gives back every HF tensor."""
    target, model = pair
    names = [name for name, _ in target.named_parameters()]
    assert any(n.endswith("qkv_proj.weight") for n in names) and any(n.endswith("gate_up_proj.weight") for n in names)
    separate = tuple(f".{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert not any(n.endswith(separate) for n in names)
    theirs, ours = model.state_dict(), hf_state_dict(target)
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_forward_logits_and_features_equal_transformers(pair):
    target, model = pair
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    logits, feats = reference(model, ids)
    torch.testing.assert_close(target.logits(ids), logits, **TOL)
    torch.testing.assert_close(target.features(ids, list(FEATURE_LAYERS)), feats, **TOL)


def test_cached_decode_steps_equal_transformers(pair):
    """Prefill 5 tokens, then 1-token steps and a 4-token (verify-sized) step: each step's logits
    and features are transformers' full forward's at those positions."""
    target, model = pair
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    logits, feats = reference(model, ids)
    decoder = Decoder(target, 1, 16, FEATURE_LAYERS, graphs=False, compile=False)
    last, prompt_feats = decoder.prefill([ids[0, :5].tolist()])
    torch.testing.assert_close(last, logits[:, 4], **TOL)
    torch.testing.assert_close(prompt_feats, feats[:, :5], **TOL)
    for start, end in ((5, 6), (6, 7), (7, 11), (11, 12)):
        step_logits, step_feats = decoder.step(ids[:, start:end])
        torch.testing.assert_close(step_logits, logits[:, start:end], **TOL)
        torch.testing.assert_close(step_feats, feats[:, start:end], **TOL)
