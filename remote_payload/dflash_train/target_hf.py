"""Any causal-LM target through transformers: Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Phi-3, ...

The hand-written Qwen3 (target.py) stays the default where it applies (`choose_backend`); every
other target is the model transformers builds from its config.json, wrapped in `HFTarget`, which
offers what the trainer and the decoders use of a target: `features` (the outputs of decoder
layers, z-lab's `hidden_states[i + 1]`), `logits`, `embed_tokens` and `lm_head` (shared with the
drafter), `compile_layers`, `cfg`. `HFDecoder` is decode.Decoder's interface over the model's own
KV cache (a transformers DynamicCache): eval, regen and the in-training tau run through it.

`transformers` is imported only when such a target is built: the native path does not need it.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import TargetConfig


def hf_config_fields(t: TargetConfig) -> dict[str, Any]:
    """transformers config keywords for a random target of this shape."""
    fields = dict(
        num_hidden_layers=t.num_layers,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        rope_parameters={"rope_theta": t.rope_theta, **(t.rope_scaling or {"rope_type": "default"})},
    )
    if t.attention_bias:
        fields["attention_bias"] = True
    if t.num_experts:
        fields.update(
            num_experts=t.num_experts,
            num_experts_per_tok=t.num_experts_per_tok,
            moe_intermediate_size=t.moe_intermediate_size,
        )
    return fields


def _truncate(config, layers: int):
    """A copy of a transformers config with only the first `layers` decoder layers."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return config


def build_hf_target(
    t: TargetConfig,
    layer_ids: list[int],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    whole: bool = False,
) -> "HFTarget":
    """The target through transformers: loaded from `t.path`, else random (seeded) of `t`'s shape.
    Only the layers up to max(layer_ids) are built unless `whole` (decoding needs every layer)."""
    import transformers

    layers = t.num_layers if whole or not layer_ids else max(layer_ids) + 1
    if t.path is not None:
        config = _truncate(transformers.AutoConfig.from_pretrained(t.path), layers)
        # Straight onto the device where transformers can (it needs accelerate for that), else via the CPU.
        placed = transformers.utils.is_accelerate_available()
        with _quiet(transformers):  # the unbuilt layers' weights are "unused": expected
            model = transformers.AutoModelForCausalLM.from_pretrained(
                t.path, config=config, dtype=dtype, **({"device_map": str(device)} if placed else {})
            )
        model.to(device)
    else:
        config = _truncate(transformers.AutoConfig.for_model(t.model_type, **hf_config_fields(t)), layers)
        with torch.device(device):  # built in place: on a GPU, an 8B model's own init takes a moment
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        _init_random(model, t, device)
    return HFTarget(model.eval().requires_grad_(False), t)


class _quiet:
    """transformers' logging at error level inside the block."""

    def __init__(self, transformers):
        self.logging = transformers.utils.logging

    def __enter__(self):
        self.level = self.logging.get_verbosity()
        self.logging.set_verbosity_error()

    def __exit__(self, *exc):
        self.logging.set_verbosity(self.level)


@torch.no_grad()
def _init_random(model: nn.Module, t: TargetConfig, device) -> None:
    """Normal(0, init_std) weights, unit norm scales, zero biases, drawn in parameter order from
    one generator seeded by `t.seed` (the same weights for the same seed and device)."""
    gen = torch.Generator(device=device).manual_seed(t.seed)
    for name, param in model.named_parameters():  # a tied LM head is listed once
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # the norms' scales: every other 1-d parameter of these models is a bias
            param.fill_(1.0)
        else:
            param.normal_(0.0, t.init_std, generator=gen)


class HFTarget(nn.Module):
    """A frozen transformers causal LM with the native target's interface (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg: TargetConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.base = model.get_decoder()
        self.layers = self.base.layers
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.on_layer: Callable[[int, int], None] | None = None  # (i, n) before layer i: progress probe
        self._stems: dict[int, nn.Module] = {}
        self._record: set[int] = set()  # layers whose outputs the current forward keeps
        self._outputs: dict[int, torch.Tensor] = {}
        self._running = 0  # layers in the current forward (for on_layer)
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after(i))

    def _before(self, i: int):
        def hook(module, args):
            if self.on_layer is not None:
                self.on_layer(i, self._running)

        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            if i in self._record:
                self._outputs[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def whole(self) -> bool:
        """Whether every layer of the checkpoint is built (decoding needs it)."""
        return len(self.layers) == self.cfg.num_layers

    def _stem(self, layers: int) -> nn.Module:
        """The base model over its first `layers` layers only (shared modules): early exit."""
        if layers == len(self.layers):
            return self.base
        if layers not in self._stems:
            stem = copy.copy(self.base)
            stem._modules = dict(self.base._modules)
            stem._modules["layers"] = nn.ModuleList(self.layers[:layers])
            stem.config = _truncate(self.base.config, layers)
            self._stems[layers] = stem
        return self._stems[layers]

    def compile_layers(self, **compile_kwargs) -> "HFTarget":
        """Regional compilation of each decoder layer's `forward`. Not `Module.compile`: that
        would trace our recording hooks too, whose layer index differs per layer, and so compile
        every layer on its own instead of one graph that all layers share."""
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
        return self

    def recording(self, layer_ids) -> "_Recording":
        """A context in which forwards keep the outputs of `layer_ids`' layers (`take` them)."""
        return _Recording(self, tuple(layer_ids))

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The outputs of decoder layers `layer_ids`, concatenated: [N, S] -> [N, S, L*H]."""
        used = max(layer_ids) + 1
        self._running = used
        with self.recording(layer_ids) as rec:
            self._stem(used)(input_ids=input_ids, use_cache=False)
            return rec.take()

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal-LM logits [N, S, V] in fp32 (needs every layer built)."""
        if not self.whole:
            raise RuntimeError("logits() needs the full target; this one stops early")
        self._running = len(self.layers)
        return self.model(input_ids=input_ids, use_cache=False).logits.float()


class _Recording:
    """See `HFTarget.recording`."""

    def __init__(self, target: HFTarget, layer_ids: tuple[int, ...]):
        self.target, self.layer_ids = target, layer_ids

    def __enter__(self) -> "_Recording":
        self.target._record, self.target._outputs = set(self.layer_ids), {}
        return self

    def take(self) -> torch.Tensor | None:
        """The recorded outputs [N, T, L*H] of the last forward, or None without feature layers."""
        if not self.layer_ids:
            return None
        return torch.cat([self.target._outputs[i] for i in self.layer_ids], dim=-1)

    def __exit__(self, *exc):
        self.target._record, self.target._outputs = set(), {}


def left_padded(prompts: list[list[int]], pad: torch.Tensor, capacity: int) -> torch.Tensor:
    """The prompts left-padded to the longest as ids [N, P] (on the CPU); each row's padding
    written into `pad` [N]. A decoder's prefill, native or transformers, starts here."""
    if len(prompts) != pad.numel():
        raise ValueError(f"{len(prompts)} prompts for a decoder of batch {pad.numel()}")
    p = max(len(q) for q in prompts)
    if p > capacity:
        raise ValueError(f"a prompt of {p} tokens does not fit the cache ({capacity})")
    ids = torch.zeros(len(prompts), p, dtype=torch.long)
    for n, q in enumerate(prompts):
        ids[n, p - len(q) :] = torch.tensor(q, dtype=torch.long)
    pad.copy_(torch.tensor([p - len(q) for q in prompts]))
    return ids


class HFDecoder:
    """decode.Decoder's interface (prefill, step, crop, length) over the model's own KV cache, for
    a batch of N left-padded rows and at most C positions. Eager (no CUDA graphs of our own)."""

    graphs = False

    def __init__(self, target: HFTarget, batch: int, capacity: int, feature_layers: tuple[int, ...] = ()):
        if not target.whole:
            raise ValueError("decoding needs the whole target (this one stops early)")
        import transformers

        self.target, self.feature_layers, self.capacity = target, tuple(feature_layers), capacity
        self.device = target.embed_tokens.weight.device
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)  # [N] left padding per row
        # No config: every layer keeps all its positions (the masks apply a sliding window), so
        # that rejected drafts can be cropped off sliding layers too (Mistral, Qwen2 with windows).
        self.cache = transformers.DynamicCache()
        params = inspect.signature(target.model.forward).parameters
        # transformers 5 names the cache argument `cache` (`past_key_values` goes in 5.40); 4.x the latter.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # A prefill asks for the last position's logits alone where the model takes it (transformers >= 4.50).
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    @property
    def length(self) -> int:
        """Positions cached."""
        return self.cache.get_seq_length()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompts (left-padded) from position 0: (last logits [N, V] fp32, features
        [N, P, L*H] or None)."""
        ids = left_padded(prompts, self.pad, self.capacity)
        self.crop(0)
        logits, feats = self._forward(ids.to(self.device), last_only=True)
        return logits[:, -1], feats

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids [N, T] after the cached positions: (logits [N, T, V] fp32, features or None)."""
        if self.length + ids.shape[1] > self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions)")
        return self._forward(ids)

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (rejected drafts)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5 takes the count to remove (negative)

    def warm_up(self, width: int = 1) -> int:
        """Nothing to capture on this path: 0 steps."""
        return 0

    def _forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over ids [N, T] after the cache: (logits [N, T, V], or [N, 1, V] with `last_only`
        (a prefill: not the head over every prompt position), features or None)."""
        start, t = self.length, ids.shape[1]
        slots = torch.arange(start + t, device=self.device)
        attention_mask = (slots[None] >= self.pad[:, None]).long()  # [N, start+T]
        positions = (slots[None, start:] - self.pad[:, None]).clamp_min(0)  # [N, T]
        self.target._running = len(self.target.layers)
        with self.target.recording(self.feature_layers) as rec:
            out = self.target.model(
                input_ids=ids,
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: self.cache},
                **(self._keep_last if last_only else {}),
            )
            return out.logits.float(), rec.take()
