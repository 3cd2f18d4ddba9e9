"""What the DFlash loaders of vLLM, SGLang and z-lab's reference read from an export, written
down from their sources (issue 28), and a check of an export against it. Pure data and the
standard library: it reads config.json and the safetensors header, never the tensors, so the
CLI can run it on a pulled export (the model card reports it) and the tests on every export.

Read on 2026-12-02; nothing here was run against an engine (no GPU on the machine that wrote
it). The engines change their DFlash support between versions: re-read the sources named in
`sources` when a new version is used, and update the requirements and this date.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

SERVABLE_DTYPES = ("BF16", "F16", "F32")  # the engines cast to the served dtype; quantized drafts need a quant config


@dataclass(frozen=True)
class Loader:
    """One engine's DFlash draft loader: what it reads from config.json and model.safetensors."""

    name: str
    sources: tuple[str, ...]  # repository path @ commit, as read
    architecture: str  # must be in config.json's `architectures`
    config_fields: tuple[str, ...]  # top-level config.json fields it reads without a default
    needs_silu: bool  # raises on any other hidden_act
    extra_weights: str  # "ignored" | "error": a weight name it has no parameter for
    rejected_weights: tuple[str, ...]  # name fragments it refuses outright


VLLM = Loader(
    name="vLLM",
    sources=(
        "vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9",
        "vllm-project/vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py "
        "@ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424",
        "vllm-project/vllm vllm/config/speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443",
    ),
    # registry -> qwen3_dflash.DFlashQwen3ForCausalLM (seen quoted; not in the registry copy read)
    architecture="DFlashDraftModel",
    # rope_theta: absent, it would default to 1e6 (set_default_rope_theta), silently wrong for other targets
    config_fields=(
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "rope_theta",
    ),
    needs_silu=False,  # Qwen3MLP takes config.hidden_act
    extra_weights="error",  # AutoWeightsLoader raises on a name with no parameter
    rejected_weights=("mask_hidden",),  # asserted absent in load_weights
)

SGLANG = Loader(
    name="SGLang",
    sources=(
        "sgl-project/sglang python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734",
        "sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582",
        "sgl-project/sglang python/sglang/srt/speculative/dflash_worker.py @ 7f151c5ebdb3af4467c2a5d3ccc5f54e71d2ba35",
    ),
    architecture="DFlashDraftModel",  # EntryClass of models/dflash.py
    # rope_theta: get_rope_config reads rope_parameters["rope_theta"], else config.rope_theta, no default
    config_fields=("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "rope_theta"),
    needs_silu=True,  # DFlashMLP: "Only silu is supported for now"
    extra_weights="ignored",  # load_weights skips names it cannot resolve
    rejected_weights=(),
)

ZLAB = Loader(
    name="z-lab DFlashDraftModel",
    sources=("z-lab/dflash dflash/model.py @ 10129599dffb338ff38cfd235a53ca6d3667b4dd",),
    architecture="DFlashDraftModel",
    config_fields=(
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "attention_dropout",
        "vocab_size",
    ),
    needs_silu=False,
    extra_weights="ignored",  # from_pretrained warns and drops it (a missing one it would leave random)
    rejected_weights=(),
)

LOADERS = (VLLM, SGLANG, ZLAB)


def dflash_value(config: dict, name: str):
    """A DFlash field as the loaders read it: `dflash_config` first, then the top level."""
    return (config.get("dflash_config") or {}).get(name, config.get(name))


def expected_weights(config: dict) -> dict[str, tuple[int, ...]]:
    """{checkpoint name: shape} that a config.json's drafter has, in every loader's naming (vLLM
    and SGLang stack q/k/v and gate/up into fused parameters at load time, from these names)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "self_attn.q_norm": (head_dim,),
        "self_attn.k_norm": (head_dim,),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }
    # Both engines size fc from the number of target layers it reads times the hidden size
    # (vLLM: `target_hidden_size` if set, else hidden_size).
    features = len(dflash_value(config, "target_layer_ids") or ())
    target_hidden = config.get("target_hidden_size") or hidden
    out = {
        f"layers.{i}.{name}.weight": shape for i in range(config["num_hidden_layers"]) for name, shape in shapes.items()
    }
    out.update(
        {"fc.weight": (hidden, features * target_hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    )
    return out


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header (the tensors are not read)."""
    return {
        name: (entry["dtype"], tuple(entry["shape"])) for name, entry in _header(path).items() if name != "__metadata__"
    }


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata a safetensors file's header carries ({} if none)."""
    return _header(path).get("__metadata__") or {}


def check_loader(loader: Loader, config: dict, weights: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """What `loader` would refuse or misread in an export (config.json + weight header); [] if nothing."""
    problems = []
    if loader.architecture not in (config.get("architectures") or []):
        problems.append(f"architectures {config.get('architectures')} lacks {loader.architecture!r}")
    missing = [f for f in loader.config_fields if f not in config]
    if missing:
        problems.append(f"config.json lacks {', '.join(missing)}")
        return problems  # the shapes below need them
    if loader.needs_silu and config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r}: only silu is supported")
    layers = config["num_hidden_layers"]
    if config.get("layer_types") is not None:  # all three read it: one type per layer
        types = config["layer_types"]
        if len(types) != layers:
            problems.append(f"layer_types has {len(types)} entries for {layers} layers")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            problems.append(f"layer_types {unknown} unsupported")
        if "sliding_attention" in types and not (
            config.get("sliding_window") or dflash_value(config, "swa_window_size")
        ):
            problems.append("sliding_attention layers without sliding_window")
    # A DFlash block attends both ways; a causal flag would change the math silently.
    if config.get("is_causal") or (config.get("dflash_config") or {}).get("causal"):
        problems.append("is_causal / dflash_config.causal set: the drafter was trained non-causal")
    ids = dflash_value(config, "target_layer_ids")
    target_layers = dflash_value(config, "num_target_layers")
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"dflash_config.target_layer_ids {ids!r}: a non-empty list of ints is required")
    elif target_layers is not None and not all(0 <= i < target_layers for i in ids):
        problems.append(f"target_layer_ids {ids} outside the target's {target_layers} layers")
    mask = dflash_value(config, "mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        problems.append(f"dflash_config.mask_token_id {mask!r}: a non-negative int is required")
    elif mask >= config.get("vocab_size", mask + 1):  # no loader resizes the target's embeddings
        problems.append(f"mask_token_id {mask} outside the target vocabulary ({config.get('vocab_size')})")
    block = dflash_value(config, "block_size")
    if not isinstance(block, int) or block < 2:
        problems.append(f"block_size {block!r}: an int >= 2 is required")
    problems += _check_weights(loader, config, weights)
    return problems


def _check_weights(loader: Loader, config: dict, weights: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    problems = []
    try:
        expected = expected_weights(config)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        return [f"config.json cannot size the weights: {exc!r}"]
    if config.get("attention_bias"):  # q/k/v/o carry biases then
        for name in [n for n in expected if n.endswith(("_proj.weight",)) and ".self_attn." in n]:
            expected[name[: -len("weight")] + "bias"] = (expected[name][0],)
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"weight {name} missing")
        elif weights[name][1] != shape:
            problems.append(f"weight {name} has shape {list(weights[name][1])}, expected {list(shape)}")
    for name, (dtype, _) in sorted(weights.items()):
        if dtype not in SERVABLE_DTYPES:
            problems.append(f"weight {name} is {dtype}, not one of {', '.join(SERVABLE_DTYPES)}")
        if any(part in name for part in loader.rejected_weights):
            problems.append(f"weight {name} is refused by the loader")
    # embed_tokens / lm_head are optional own copies in vLLM; anything else is unknown to all three.
    extra = sorted(set(weights) - set(expected) - {"embed_tokens.weight", "lm_head.weight"})
    if extra and loader.extra_weights == "error":
        problems.append(f"unexpected weights {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return problems


def check_export(path: str | Path) -> dict[str, list[str]]:
    """{loader name: problems} for an export directory (config.json + model.safetensors)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = read_safetensors_header(path / "model.safetensors")
    return {loader.name: check_loader(loader, config, weights) for loader in LOADERS}


# The serve commands' flags: the engines' sources above, and z-lab's README (block-16 drafters
# with "num_speculative_tokens": 15 in vLLM, --speculative-num-draft-tokens 16 in SGLang).
COMMAND_SOURCES = ("z-lab/dflash README.md @ 0a2da2366b9bf74a014fc9b648dfc2615dacbfb7",)


def serve_commands(config: dict, export: str = "EXPORT", target: str = "TARGET") -> dict[str, str]:
    """The serve command of each engine for an export with this config.json (read, not run here)."""
    block = dflash_value(config, "block_size")
    spec = json.dumps({"method": "dflash", "model": export, "num_speculative_tokens": block - 1})
    # SGLang's `auto` dtype serves a float32 checkpoint as float16 (model_config._get_and_verify_dtype)
    # while its extend path hands the draft bf16 embeddings: a float32 export is served as bf16.
    dtype = " --dtype bfloat16" if config.get("torch_dtype") == "float32" else ""
    return {
        # A DFlash block attends both ways: vLLM needs a backend with non-causal attention.
        "vLLM": f"vllm serve {target} --speculative-config '{spec}' --attention-backend flash_attn",
        "SGLang": (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {export} --speculative-num-draft-tokens {block} "
            f"--attention-backend fa3{dtype} --trust-remote-code"
        ),
    }
