"""The frozen target: our own Qwen3 (no `transformers` needed), loaded from a local HF directory
or initialised at random (the tiny demo target and the benchmark shapes)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import TargetConfig
from .model import DecoderLayer, RMSNorm, Shape, rope_cos_sin

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


class Qwen3Target(nn.Module):
    """Qwen3 causal LM with HF-compatible submodule names (minus the `model.` prefix).

    Only the first `num_built_layers` layers exist: features stop after the last one needed.
    """

    def __init__(self, cfg: TargetConfig, num_built_layers: int):
        super().__init__()
        self.cfg = cfg
        self.shape = shape_of(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.shape) for _ in range(num_built_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)
        self.on_layer: Callable[[int, int], None] | None = None  # (i, n) before layer i: progress probe

    def compile_layers(self, **compile_kwargs) -> "Qwen3Target":
        """Regional compilation of the decoder layers' causal `forward` (used by `features` and
        `logits`; decode.py, the KV-cached path, calls the layers' parts and stays eager). The
        layers share one compiled graph; it fuses the RMSNorms, q/k norms, RoPE and SwiGLU that eager runs as
        ~30 separate memory-bound kernels per layer. `compile_kwargs` go to `torch.compile`."""
        for layer in self.layers:
            layer.compile(**compile_kwargs)
        return self

    def _rope(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        positions = torch.arange(seq_len, device=device)[None]  # [1, S]
        return rope_cos_sin(positions, self.shape.head_dim, self.shape.rope_theta, dtype)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Hidden states after each layer in `layer_ids`, concatenated: [N, S] -> [N, S, L*H]."""
        x = self.embed_tokens(input_ids)  # [N, S, H]
        cos, sin = self._rope(input_ids.shape[1], input_ids.device, x.dtype)
        wanted, out = set(layer_ids), {}
        used = self.layers[: max(layer_ids) + 1]  # early exit
        for i, layer in enumerate(used):
            if self.on_layer is not None:
                self.on_layer(i, len(used))
            x = layer(x, cos, sin)
            if i in wanted:
                out[i] = x
        return torch.cat([out[i] for i in layer_ids], dim=-1)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal-LM logits [N, S, V] (needs every layer built; used to generate demo data)."""
        if len(self.layers) != self.cfg.num_layers:
            raise RuntimeError("logits() needs the full target; this one stops early")
        x = self.embed_tokens(input_ids)
        cos, sin = self._rope(input_ids.shape[1], input_ids.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)).float()


def shape_of(cfg: TargetConfig) -> Shape:
    """The per-layer shape of a target config."""
    return Shape(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        cfg.rope_theta,
    )


def build_random_target(
    cfg: TargetConfig,
    seed: int,
    num_built_layers: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Qwen3Target:
    """A randomly initialised target (deterministic for seed + device); no files needed."""
    with torch.device("meta"):
        target = Qwen3Target(cfg, num_built_layers or cfg.num_layers)
    target.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight  # to_empty breaks the tie
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, cfg.init_std, generator=gen)
    return target


def build_tiny_target(cfg: TargetConfig, seed: int) -> Qwen3Target:
    """The random tiny target, full depth, fp32 on CPU (same on every machine)."""
    return build_random_target(cfg, seed)


def read_hf_config(path: str | Path) -> TargetConfig:
    """TargetConfig fields from a HF Qwen3 `config.json` (checks it is a Qwen3 without biases)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type") not in ("qwen3", None):
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not qwen3")
    if raw.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias=true is not supported")
    rope = raw.get("rope_parameters") or {}
    return TargetConfig(
        path=str(path),
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        vocab_size=raw["vocab_size"],
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 1e6))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def load_hf_target(
    path: str | Path,
    layer_ids: list[int],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    whole: bool = False,
) -> Qwen3Target:
    """Load a HF Qwen3 checkpoint dir (config.json + *.safetensors): only the layers up to
    max(layer_ids), or (whole) every layer, as speculative decoding needs."""
    path = Path(path)
    cfg = read_hf_config(path)
    num_built = cfg.num_layers if whole else max(layer_ids) + 1
    with torch.device("meta"):
        target = Qwen3Target(cfg, num_built)
    wanted = {_hf_name(name): name for name in target.state_dict()}
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key in wanted:
                    tensors[wanted[key]] = f.get_tensor(key).to(dtype)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        # Some checkpoints tie without saying so; the LM head is then the embedding.
        tensors["lm_head.weight"] = tensors.get("embed_tokens.weight")
    missing = [hf for hf, ours in wanted.items() if ours not in tensors or tensors[ours] is None]
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    target.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight
    return target.requires_grad_(False)


def _hf_name(name: str) -> str:
    """Our parameter name -> the HF checkpoint key."""
    return name if name.startswith("lm_head") else f"model.{name}"


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
