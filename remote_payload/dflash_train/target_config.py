"""What a target is, read from its config.json and tokenizer without building it: the fields of
any HF causal LM, the backend that computes it, the drafter's rope, the feature layers and the MASK
id. Standard library only (with the config module): the run plan and the pre-flight use it without
importing torch.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from .config import ConfigError, TargetConfig

MASK_TOKEN = "<|MASK|>"


def default_target_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """`count` layers spread evenly from layer 1 to layer num_layers-3, rounded half up, deduplicated.

    36 layers -> [1, 9, 17, 25, 33]; 28 -> [1, 7, 13, 19, 25]; 6 -> [1, 2, 3].
    """
    first, last = 1, max(1, num_layers - 3)
    count = max(1, min(count, last - first + 1))
    if count == 1:
        return [min(first, num_layers - 1)]
    step = (last - first) / (count - 1)
    return sorted({first + math.floor(i * step + 0.5) for i in range(count)})


# Architectures whose config.json names no causal-LM class (`architectures`), known as encoders.
ENCODER_ONLY = (
    "bert",
    "roberta",
    "xlm-roberta",
    "deberta",
    "deberta-v2",
    "distilbert",
    "electra",
    "albert",
    "modernbert",
    "mpnet",
)
# Rope types the drafter's own rope implements (model.rope_inv_freq); a target with another keeps
# none of its scaling in the drafter: `drafter_rope` refuses it.
DRAFTER_ROPE_TYPES = ("default", "linear", "llama3")


def read_target_config(path: str | Path) -> TargetConfig:
    """TargetConfig fields from any HF causal LM's `config.json` (ValueError, one line, for a
    model that cannot be a target: an encoder-only or encoder-decoder one)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    check_causal(raw, str(path))
    heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    return TargetConfig(
        path=str(path),
        model_type=raw.get("model_type") or "unknown",
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size") or 4 * raw["hidden_size"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        vocab_size=raw["vocab_size"],
        rope_theta=float(theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-6))),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling_of(rope),
        attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
        num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
    )


def check_causal(raw: dict, where: str) -> None:
    """ValueError unless a config.json describes a decoder-only causal LM."""
    archs = raw.get("architectures") or []
    if raw.get("is_encoder_decoder"):
        raise ValueError(
            f"{where}: {raw.get('model_type')} is an encoder-decoder model; a target must be a decoder-only causal LM"
        )
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs):
        raise ValueError(f"{where}: {', '.join(archs)} is not a causal LM (encoder-only models cannot be targets)")
    if not archs and raw.get("model_type") in ENCODER_ONLY:
        raise ValueError(f"{where}: model_type {raw['model_type']} is encoder-only; a target must be a causal LM")


def rope_scaling_of(rope: dict) -> dict | None:
    """A config's rope parameters less theta, or None when they are plain rope."""
    rest = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = rest.pop("rope_type", rest.pop("type", "default"))
    return None if kind == "default" else {"rope_type": kind, **rest}


def drafter_rope(target: TargetConfig) -> tuple[tuple[str, Any], ...]:
    """The target's rope scaling as the drafter's Shape holds it (hashable), or ConfigError for a
    rope type the drafter does not implement."""
    scaling = target.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind not in DRAFTER_ROPE_TYPES:
        raise ConfigError(f"target rope_type {kind!r}: the drafter implements {', '.join(DRAFTER_ROPE_TYPES)} only")
    return () if kind == "default" else tuple(sorted(scaling.items()))


def choose_backend(t: TargetConfig) -> tuple[str, str]:
    """(native | transformers, why) for `target.backend`: auto takes the hand-written Qwen3 where
    it computes the same model (faster: fused, one CUDA graph per step), transformers elsewhere."""
    why_not = native_misfit(t)
    if t.backend == "native":
        if why_not:
            raise ConfigError(f"target.backend native cannot run this target: {why_not}")
        return "native", "target.backend native"
    if t.backend == "transformers":
        return "transformers", "target.backend transformers"
    if why_not:
        return "transformers", f"auto: {why_not}"
    return "native", "auto: a dense Qwen3 without biases or rope scaling (the hand-written path is faster)"


def native_misfit(t: TargetConfig) -> str | None:
    """Why the hand-written Qwen3 cannot compute this target, or None when it can."""
    if t.model_type != "qwen3":
        return f"model_type {t.model_type} is not qwen3"
    if t.attention_bias:
        return "attention_bias"
    if t.rope_scaling:
        return f"rope scaling {t.rope_scaling.get('rope_type')}"
    if t.num_experts:
        return "mixture of experts"
    return None


def resolve_target_config(t: TargetConfig, notes: list[str] | None = None) -> TargetConfig:
    """The target's fields read from its config.json (when `t.path` is set) with the backend
    decided (`choose_backend`, its reason appended to `notes`); ConfigError for a target that
    cannot be one, or whose rope the drafter cannot take."""
    if t.path is not None:
        try:
            loaded = read_target_config(t.path)
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"target.path: {exc}") from None
        loaded.seed, loaded.init_std, loaded.backend = t.seed, t.init_std, t.backend
        t = loaded
    else:
        t = copy.deepcopy(t)
    t.backend, why = choose_backend(t)
    drafter_rope(t)
    if notes is not None:
        notes.append(f"target backend: {t.backend} ({why})")
    return t


def resolve_mask_token_id(target_cfg: TargetConfig, configured: int | None, tokenizer_path: str | None = None) -> int:
    """The MASK token id: configured, else `<|MASK|>` from tokenizer.json (in `tokenizer_path`,
    else `target.path`), else the first id the tokenizer does not use."""
    if configured is not None:
        if not 0 <= configured < target_cfg.vocab_size:
            raise ValueError(f"mask_token_id {configured} outside the vocabulary ({target_cfg.vocab_size})")
        return configured
    tok_dir = tokenizer_path or target_cfg.path
    if tok_dir is None:
        return target_cfg.vocab_size - 1  # the random target reserves its last id; demo data never uses it
    tok_file = Path(tok_dir) / "tokenizer.json"
    if not tok_file.exists():
        raise ValueError(f"{tok_dir} has no tokenizer.json: set drafter.mask_token_id")
    tok = json.loads(tok_file.read_text())
    ids = dict(tok["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    if MASK_TOKEN in ids:
        if ids[MASK_TOKEN] >= target_cfg.vocab_size:
            raise ValueError(
                f"{tok_file}: {MASK_TOKEN} is id {ids[MASK_TOKEN]}, outside the target's "
                f"vocabulary ({target_cfg.vocab_size})"
            )
        return ids[MASK_TOKEN]
    # Qwen3 checkpoints pad the embedding beyond the tokenizer; the first spare row becomes MASK
    # (z-lab's Qwen3 drafters use 151669 this way).
    first_unused = max(ids.values()) + 1
    if first_unused >= target_cfg.vocab_size:
        raise ValueError("no spare embedding row for the MASK token: set drafter.mask_token_id")
    return first_unused
