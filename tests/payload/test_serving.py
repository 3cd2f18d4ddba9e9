"""Issue 28: every export the trainer writes against what vLLM's, SGLang's and z-lab's DFlash
loaders read (dflashctl/serving.py, written down from their sources); and the check itself
catches each fault it names, so a passing export is not a check that cannot fail."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.config import load_config
from dflash_train.export import drafter_config, export_drafter
from dflash_train.model import DFlashDrafter
from dflash_train.plan import resolve_run
from dflash_train.resolve import drafter_spec
from dflashctl.serving import LOADERS, SGLANG, VLLM, ZLAB, check_export, check_loader, serve_commands


def _export(tmp_path, overrides: list[str], dtype: torch.dtype):
    cfg = resolve_run(load_config(overrides=[f"run.output_dir={tmp_path / 'run'}", *overrides]), cuda_count=0).cfg
    drafter = DFlashDrafter(drafter_spec(cfg))
    return export_drafter(drafter, cfg.target, tmp_path / "export", dtype)


@pytest.mark.parametrize(
    "overrides,dtype",
    [([], torch.bfloat16), ([], torch.float32), (["drafter.num_layers=3", "drafter.block_size=16"], torch.bfloat16)],
)
def test_exports_meet_every_loaders_requirements(tmp_path, overrides, dtype):
    export = _export(tmp_path, overrides, dtype)
    assert check_export(export) == {loader.name: [] for loader in LOADERS}


def test_the_8b_preset_export_meets_them_too():
    """The qwen3-8b preset's shapes (built on the meta device: 1 GB of weights need not exist)."""
    cfg = resolve_run(load_config(preset="qwen3-8b"), cuda_count=0).cfg
    spec = drafter_spec(cfg)
    with torch.device("meta"):
        drafter = DFlashDrafter(spec)
    config = json.loads(json.dumps(drafter_config(spec, cfg.target, torch.bfloat16)))
    weights = {name: ("BF16", tuple(t.shape)) for name, t in drafter.state_dict().items()}
    assert all(check_loader(loader, config, weights) == [] for loader in LOADERS)
    commands = serve_commands(config, "./run/export", "Qwen/Qwen3-8B")
    assert commands["vLLM"] == (
        'vllm serve Qwen/Qwen3-8B --speculative-config \'{"method": "dflash", "model": '
        '"./run/export", "num_speculative_tokens": 15}\' --attention-backend flash_attn'
    )
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path ./run/export" in commands["SGLang"]
    assert "--speculative-num-draft-tokens 16" in commands["SGLang"] and "--dtype" not in commands["SGLang"]
    # A float32 export (a CPU run's): SGLang's `auto` would serve it as float16 beside bf16 embeddings.
    fp32 = serve_commands({**config, "torch_dtype": "float32"}, "./run/export", "Qwen/Qwen3-8B")
    assert "--attention-backend fa3 --dtype bfloat16 --trust-remote-code" in fp32["SGLang"]
    assert fp32["vLLM"] == commands["vLLM"]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """One tiny bf16 export, copied by each fault below before it is broken."""
    tmp = tmp_path_factory.mktemp("serving")
    return _export(tmp, [], torch.bfloat16)


def _broken(tiny_export, tmp_path, config_edit=None, weights_edit=None):
    out = tmp_path / "broken"
    shutil.copytree(tiny_export, out)
    if config_edit is not None:
        config = json.loads((out / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    if weights_edit is not None:
        tensors = load_file(str(out / "model.safetensors"))
        weights_edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return check_export(out)


def test_a_missing_weight_fails_every_loader(tiny_export, tmp_path):
    result = _broken(tiny_export, tmp_path, weights_edit=lambda t: t.pop("layers.0.self_attn.k_norm.weight"))
    assert all(any("layers.0.self_attn.k_norm.weight missing" in p for p in problems) for problems in result.values())


def test_fc_sized_for_other_target_layers_fails(tiny_export, tmp_path):
    def more_layers(config):
        config["dflash_config"]["target_layer_ids"] = [1, 2, 3, 4]

    result = _broken(tiny_export, tmp_path, config_edit=more_layers)
    assert all(
        any("weight fc.weight has shape [64, 192], expected [64, 256]" in p for p in problems)
        for problems in result.values()
    )


def test_mask_id_beyond_the_vocabulary_and_out_of_range_layers_fail(tiny_export, tmp_path):
    def bad_ids(config):
        config["dflash_config"]["mask_token_id"] = config["vocab_size"]
        config["dflash_config"]["target_layer_ids"] = [1, 2, 6]  # the tiny target has 6 layers: 0..5

    problems = _broken(tiny_export, tmp_path, config_edit=bad_ids)[SGLANG.name]
    assert "mask_token_id 512 outside the target vocabulary (512)" in problems
    assert "target_layer_ids [1, 2, 6] outside the target's 6 layers" in problems


def test_sliding_layers_without_a_window_and_a_causal_flag_fail(tiny_export, tmp_path):
    def sliding(config):
        config["layer_types"] = ["sliding_attention"]
        config["is_causal"] = True

    problems = _broken(tiny_export, tmp_path, config_edit=sliding)[VLLM.name]
    assert "sliding_attention layers without sliding_window" in problems
    assert any(p.startswith("is_causal") for p in problems)


def test_loader_specific_faults(tiny_export, tmp_path):
    """SGLang alone refuses a non-silu MLP; vLLM alone refuses an unknown weight (its loader
    raises; it also asserts there is no mask_hidden), which SGLang and z-lab's from_pretrained drop."""

    def gelu(config):
        config["hidden_act"] = "gelu"

    result = _broken(tiny_export, tmp_path, config_edit=gelu)
    assert result[SGLANG.name] == ["hidden_act 'gelu': only silu is supported"]
    assert result[VLLM.name] == result[ZLAB.name] == []

    def extra(tensors):
        tensors["mask_hidden"] = torch.zeros(64, dtype=torch.bfloat16)

    result = _broken(tiny_export, tmp_path / "extra", weights_edit=extra)
    assert result[SGLANG.name] == result[ZLAB.name] == []
    assert result[VLLM.name] == ["weight mask_hidden is refused by the loader", "unexpected weights mask_hidden"]


def test_a_config_without_rope_theta_fails_where_a_default_would_misread_it(tiny_export, tmp_path):
    """vLLM would take 1e6 (the tiny target's is 1e4); SGLang has no default; z-lab's takes Qwen3Config's."""
    result = _broken(tiny_export, tmp_path, config_edit=lambda config: config.pop("rope_theta"))
    assert result[VLLM.name] == result[SGLANG.name] == ["config.json lacks rope_theta"]


def test_a_renamed_architecture_fails(tiny_export, tmp_path):
    def rename(config):
        config["architectures"] = ["Qwen3ForCausalLM"]

    result = _broken(tiny_export, tmp_path, config_edit=rename)
    assert all(
        problems == ["architectures ['Qwen3ForCausalLM'] lacks 'DFlashDraftModel'"] for problems in result.values()
    )
