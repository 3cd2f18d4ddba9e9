"""The frozen target: feature layers, HF checkpoint loading, early exit, greedy generation, MASK id."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.config import TargetConfig
from dflash_train.target import build_tiny_target, hf_state_dict, load_hf_target
from dflash_train.target_config import default_target_layer_ids, resolve_mask_token_id


@pytest.mark.parametrize(
    "layers,count,expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B (issue 6)
        (28, 5, [1, 7, 13, 19, 25]),  # Qwen3-1.7B/0.6B shape (issue 6)
        (48, 8, [1, 7, 14, 20, 26, 32, 39, 45]),  # z-lab Qwen3.5-122B-A10B-DFlash's published ids
        (6, 5, [1, 2, 3]),  # tiny: fewer distinct layers than asked for
    ],
)
def test_default_target_layer_ids(layers, count, expected):
    assert default_target_layer_ids(layers, count) == expected


def write_hf_checkpoint(target, path, tie):
    """Save `target` the way HF does: config.json + two safetensors shards with `model.` keys."""
    cfg = target.cfg
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "num_hidden_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "vocab_size": cfg.vocab_size,
                "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_norm_eps,
                "tie_word_embeddings": tie,
            }
        )
    )
    # Clones: the split projections are views of one fused weight, which safetensors refuses to save.
    state = {k: v.clone() for k, v in hf_state_dict(target).items() if not (tie and k.startswith("lm_head"))}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[1::2]}, str(path / "model-00002-of-00002.safetensors"))


@pytest.mark.parametrize("tie", [True, False])
def test_hf_checkpoint_loads_only_needed_layers_with_same_features(tmp_path, tie):
    cfg = TargetConfig(tie_word_embeddings=tie)
    full = build_tiny_target(cfg, seed=3)
    write_hf_checkpoint(full, tmp_path / "ckpt", tie)
    loaded = load_hf_target(tmp_path / "ckpt", [1, 3], dtype=torch.float32)
    assert len(loaded.layers) == 4  # early exit: layers 4 and 5 are never built
    ids = torch.randint(0, 512, (2, 20))
    torch.testing.assert_close(loaded.features(ids, [1, 3]), full.features(ids, [1, 3]))
    torch.testing.assert_close(loaded.lm_head.weight, full.lm_head.weight)
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tie
    assert not any(p.requires_grad for p in loaded.parameters())


def test_features_are_the_hidden_states_after_each_layer():
    target = build_tiny_target(TargetConfig(), seed=0)
    ids = torch.randint(0, 512, (2, 12))
    feats = target.features(ids, [1, 2])
    assert feats.shape == (2, 12, 2 * 64)
    x = target.embed_tokens(ids)
    cos, sin = target._rope(12, ids.device, x.dtype)
    outs = []
    for layer in target.layers[:3]:
        x = layer(x, cos, sin)
        outs.append(x)
    torch.testing.assert_close(feats, torch.cat([outs[1], outs[2]], -1))


def test_mask_token_id(tmp_path):
    assert resolve_mask_token_id(TargetConfig(), None) == 511
    assert resolve_mask_token_id(TargetConfig(), 7) == 7
    with pytest.raises(ValueError):
        resolve_mask_token_id(TargetConfig(), 512)
    tok = {"model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 3, "content": "<|im_end|>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    hf = TargetConfig(path=str(tmp_path), vocab_size=10)
    assert resolve_mask_token_id(hf, None) == 4  # first spare embedding row (151669 on Qwen3)
    tok["added_tokens"].append({"id": 4, "content": "<|MASK|>"})
    tok["added_tokens"].append({"id": 5, "content": "<|other|>"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert resolve_mask_token_id(hf, None) == 4
    with pytest.raises(ValueError, match=r"<\|MASK\|> is id 4, outside the target's vocabulary \(4\)"):
        resolve_mask_token_id(TargetConfig(path=str(tmp_path), vocab_size=4), None)


def test_mask_token_id_from_data_tokenizer_path(tmp_path):
    # data.tokenizer_path is the tokenizer the data were made with: it wins over target.path's,
    # and gives a random target the tokenizer's MASK instead of its last id.
    (tmp_path / "data_tok").mkdir()
    tok = {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2, "content": "<|MASK|>"}]}
    (tmp_path / "data_tok" / "tokenizer.json").write_text(json.dumps(tok))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    data_tok = str(tmp_path / "data_tok")
    assert resolve_mask_token_id(TargetConfig(vocab_size=10), None, data_tok) == 2
    assert resolve_mask_token_id(TargetConfig(path=str(tmp_path), vocab_size=10), None, data_tok) == 2
    assert resolve_mask_token_id(TargetConfig(path=str(tmp_path), vocab_size=10), None) == 1
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        resolve_mask_token_id(TargetConfig(vocab_size=10), None, str(tmp_path / "nowhere"))
