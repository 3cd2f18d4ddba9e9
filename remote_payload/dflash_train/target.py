"""The frozen target: our own Qwen3 (no `transformers` needed), loaded from a local HF directory
or initialised at random (the tiny demo target and the benchmark shapes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .config import TargetConfig
from .model import Attention, DecoderLayer, RMSNorm, Shape, rope_cos_sin, to_empty


class FusedAttention(nn.Module):
    """The target's Qwen3 attention with q, k and v stacked in one weight: one GEMM (a GEMV when
    decoding one token) reads all three instead of three launches, two of them small."""

    def __init__(self, shape: Shape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.qkv_proj = nn.Linear(h, (shape.num_heads + 2 * shape.num_kv_heads) * d, bias=False)  # rows: q | k | v
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> normed queries [N, nh, T, d], normed keys and values [N, nkv, T, d] (before RoPE)."""
        n, t, _ = x.shape
        heads = self.qkv_proj(x).view(n, t, -1, self.head_dim)  # [N, T, nh + 2 nkv, d]
        q, k, v = heads.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=2)  # views
        return self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)

    output = Attention.output
    causal = Attention.causal


class FusedMLP(nn.Module):
    """SwiGLU with gate and up stacked in one weight (one GEMM for both)."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)  # rows: gate | up
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views of [..., 2I]
        return self.down_proj(F.silu(gate) * up)


def hf_parts(name: str, rows: int, shape: Shape) -> list[tuple[str, int]]:
    """Our parameter `name` of `rows` rows -> the HF checkpoint keys it holds and their row counts,
    in row order (one key for all but the fused projections)."""
    hf = name if name.startswith("lm_head") else f"model.{name}"
    q, kv, inter = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    if name.endswith("self_attn.qkv_proj.weight"):
        stem = hf.removesuffix("qkv_proj.weight")
        return [(f"{stem}q_proj.weight", q), (f"{stem}k_proj.weight", kv), (f"{stem}v_proj.weight", kv)]
    if name.endswith("mlp.gate_up_proj.weight"):
        stem = hf.removesuffix("gate_up_proj.weight")
        return [(f"{stem}gate_proj.weight", inter), (f"{stem}up_proj.weight", inter)]
    return [(hf, rows)]


def hf_state_dict(target: "Qwen3Target") -> dict[str, torch.Tensor]:
    """`state_dict()` under HF Qwen3 keys (a tied LM head too, as HF's own state_dict lists it), the
    fused projections split back into views (no copies)."""
    out = {}
    for name, param in target.state_dict().items():
        parts = hf_parts(name, param.shape[0], target.shape)
        out.update(zip([key for key, _ in parts], param.split([rows for _, rows in parts])))
    return out


class Qwen3Target(nn.Module):
    """Qwen3 causal LM with HF-compatible submodule names (minus the `model.` prefix), except that
    each layer's q/k/v and gate/up projections are fused (`hf_parts` maps them).

    Only the first `num_built_layers` layers exist: features stop after the last one needed.
    """

    def __init__(self, cfg: TargetConfig, num_built_layers: int):
        super().__init__()
        self.cfg = cfg
        self.shape = shape_of(cfg)
        # Its weight passed in: nn.Embedding's own init (normal_) on the meta device, where every
        # target is built, runs a Python decomposition that imports torch._dynamo (~1.5 s of CPU per
        # process that never compiles). Built on a real device, it gets that same init.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(self.shape, FusedAttention, FusedMLP) for _ in range(num_built_layers))
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
    to_empty(target, device).to(dtype)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight  # to_empty breaks the tie
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # A fused weight is drawn part by part in HF order: the values the separate weights had.
            for part in param.split([rows for _, rows in hf_parts(name, param.shape[0], target.shape)]):
                part.normal_(0.0, cfg.init_std, generator=gen)
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
    shapes = {name: meta.shape for name, meta in target.state_dict().items()}
    wanted = _hf_layout(shapes, target.shape)
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight", None)
    tensors: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                name, first, rows = wanted[key]
                found.add(key)
                if rows == shapes[name][0]:
                    tensors[name] = f.get_tensor(key).to(dtype)
                    continue
                # A fused weight is allocated once and each part copied into its rows as it is read:
                # the separate tensors never sit in memory beside it.
                fused = tensors.setdefault(name, torch.empty(shapes[name], dtype=dtype, device=device))
                fused[first : first + rows].copy_(f.get_tensor(key))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in found and "embed_tokens.weight" in tensors:
        # Some checkpoints tie without saying so; the LM head is then the embedding.
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
        found.add("lm_head.weight")
    missing = [key for key in wanted if key not in found]
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    target.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight
    return target.requires_grad_(False)


def _hf_layout(shapes: dict[str, torch.Size], shape: Shape) -> dict[str, tuple[str, int, int]]:
    """HF checkpoint key -> (our parameter, its first row, rows) for parameters of these shapes."""
    layout = {}
    for name, size in shapes.items():
        first = 0
        for key, rows in hf_parts(name, size[0], shape):
            layout[key] = (name, first, rows)
            first += rows
    return layout
