"""Export the drafter in the layout of the published z-lab DFlash drafters
(e.g. z-lab/Qwen3-8B-DFlash-b16): `config.json` + `model.safetensors`, no embedding or LM head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import TargetConfig
from .model import DFlashDrafter, DrafterSpec, Shape

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def drafter_config(spec: DrafterSpec, target: TargetConfig, dtype: torch.dtype) -> dict:
    """The HF-style config.json of an exported drafter (Qwen3 fields + DFlash fields)."""
    s = spec.shape
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": dict(s.rope_scaling) or None,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": target.tie_word_embeddings,
        "use_sliding_window": bool(spec.layer_types),
        "sliding_window": spec.sliding_window if spec.layer_types else None,
        "layer_types": [spec.layer_type(i) for i in range(spec.num_layers)],
        "initializer_range": 0.02,
        "torch_dtype": DTYPE_NAMES[dtype],
        "block_size": spec.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {
            "target_layer_ids": list(spec.target_layer_ids),
            "mask_token_id": spec.mask_token_id,
        },
    }


def export_drafter(
    drafter: DFlashDrafter, target: TargetConfig, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write `config.json` and `model.safetensors` (weights cast to `dtype`) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    metadata = {"format": "pt"}
    device = next(drafter.parameters()).device
    if device.type == "cuda":  # the model card's hardware line (`runs pull`)
        metadata["gpu"] = torch.cuda.get_device_name(device)
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    config = drafter_config(drafter.spec, target, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # config.json's auto_map names dflash.DFlashDraftModel: the modeling file and the trainer's
    # own model.py beside it, so `AutoModel.from_pretrained(out, trust_remote_code=True)` works.
    here = Path(__file__).resolve().parent
    shutil.copyfile(here / "hf" / "dflash.py", out / "dflash.py")
    shutil.copyfile(here / "model.py", out / "dflash_model.py")
    return out


def spec_from_config(config: dict) -> DrafterSpec:
    """The DrafterSpec an exported config.json describes."""
    shape = Shape(
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["rms_norm_eps"],
        config["rope_theta"],
        tuple(sorted((config.get("rope_scaling") or {}).items())),
    )
    dflash = config["dflash_config"]
    types = tuple(config.get("layer_types") or ())
    sliding = "sliding_attention" in types
    return DrafterSpec(
        shape,
        config["num_hidden_layers"],
        config["block_size"],
        tuple(dflash["target_layer_ids"]),
        dflash["mask_token_id"],
        types if sliding else (),
        config.get("sliding_window") if sliding else None,
    )


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> tuple[DFlashDrafter, dict]:
    """Reload an exported drafter (weights kept in their saved dtype) and its config dict."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        drafter = DFlashDrafter(spec_from_config(config))
    drafter.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)), strict=True, assign=True)
    return drafter, config
