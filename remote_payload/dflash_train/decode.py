"""KV-cached decoding of the target: the one decode path in the payload.

Everything that runs the target token by token goes through `Decoder`: the greedy reference of
`dflashctl eval` (`greedy`), the speculative loop's verify step (speculate.py), batched
generation for data regeneration and the demo data (`generate`).

The cache is static, as in gpt-fast: per layer one key and one value buffer [N, nkv, C, d]
allocated once for C positions. A step writes the new tokens' keys and values at slots
length..length+T-1 and attends over a window of the first W slots under a mask, so that the
step's shapes depend only on (T, W). On CUDA each (T, W) step is captured once as a CUDA graph
and replayed (W rounds up to a multiple of `window_step(C)`), and the layer's work before and after
attention is compiled (one graph each, shared by every layer): eager, an 8B decode step is
~1,600 small kernels, whose gaps cost more than reading the weights (on an H200: 8.3 ms a step
in a CUDA graph of eager layers, 6.5 ms with the parts compiled, against a 3.5 ms floor).

Batches are left-padded: row n's prompt starts at slot pad[n]; its positions (RoPE) count from
there and keys before it are masked. Cropping (rejected drafts) only moves `length` back: the
stale slots are masked until they are overwritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import DecoderLayer, apply_rope, rope_cos_sin
from .target import Qwen3Target
from .target_hf import HFDecoder, HFTarget, left_padded

# Under CUDA graphs a step attends over W slots, W a multiple of window_step(C): at most WINDOWS
# windows per cache, each a graph captured once, and a multiple of WINDOW_ALIGN slots. The rounding
# is read as if written: at 8B, batch 64 (a regen batch), attention is 1.2 of a step's 6.2 ms of
# kernels at 384 slots, and a fixed 256-slot step read a third more slots than written on average.
WINDOWS = 16
WINDOW_ALIGN = 64
# A prefill runs its rows in groups of about this many prompt tokens, so its activations (~100 kB
# a token at 8B: the MLP's 12,288-wide gate, up and product in bf16) stay near 1.6 GB at any batch,
# where one forward over 256 rows of 1,024-token prompts would hold ~26 GB beside the KV cache.
# A group of 16k tokens is still a large GEMM: the prefill stays compute-bound.
PREFILL_TOKENS = 16384


class StepGraphs:
    """CUDA graphs of step functions, one per key (the step's shapes): the first call of a key runs
    the function once eagerly on a side stream (cuBLAS, the allocator and any compile happen
    there) and captures it; every call copies its tensor inputs into the graph's static copies and
    replays. Outputs are the graph's own buffers, valid until the next replay of that key. Steps
    must be idempotent (a cache write at given slots), since the first call runs twice."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}

    def run(self, key: object, fn, *inputs: torch.Tensor):
        """fn(*inputs) by replay of its graph for `key` (captured on first use)."""
        if key not in self.graphs:
            static = [x.clone() for x in inputs]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                fn(*static)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other worker threads may launch work while this one captures.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = fn(*static)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return out


class Decoder:
    """The whole target as a static-KV-cache decoder for a batch of N rows and C positions."""

    def __init__(
        self,
        target: Qwen3Target,
        batch: int,
        capacity: int,
        feature_layers: tuple[int, ...] = (),
        graphs: bool | None = None,
        compile: bool | None = None,
    ):
        if len(target.layers) != target.cfg.num_layers:
            raise ValueError("decoding needs the whole target (this one stops early)")
        weight = target.embed_tokens.weight
        self.target, self.feature_layers = target, tuple(feature_layers)
        self.device, self.dtype = weight.device, weight.dtype
        self.capacity = capacity
        s = target.shape
        self.keys = [
            torch.zeros(batch, s.num_kv_heads, capacity, s.head_dim, device=self.device, dtype=self.dtype)
            for _ in target.layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)  # [N] left padding per row
        self.length = 0  # slots written
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._graphs = StepGraphs(self.device) if self.graphs else None
        # Steps (not the prefill, whose shape is the prompts') run the layers' parts compiled.
        self._layers = CachedLayers(self.graphs if compile is None else compile)

    # -- the steps -------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the prompts (left-padded to the longest) from slot 0: (the last position's logits
        [N, V] in fp32, features [N, P, L*H] or None). Eager: its shape is the prompts'."""
        ids = left_padded(prompts, self.pad, self.capacity).to(self.device)
        p = self.length = ids.shape[1]
        start, group = torch.zeros(1, dtype=torch.long, device=self.device), max(1, PREFILL_TOKENS // p)
        parts = [
            self._forward(ids[a : a + group], start, p, prefill=True, rows=slice(a, a + group))
            for a in range(0, len(prompts), group)
        ]
        feats = None if parts[0][1] is None else torch.cat([f for _, f in parts])
        return torch.cat([logits[:, -1] for logits, _ in parts]), feats

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids [N, T] after the cached slots: (logits [N, T, V] fp32, features [N, T, L*H] or
        None). Under CUDA graphs the results are the graph's buffers: use them before the next step."""
        t = ids.shape[1]
        if self.length + t > self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions)")
        window = window_for(self.length + t, self.capacity, self.graphs)
        start = on_device(self.length, self.device)
        self.length += t
        if not self.graphs:
            return self._forward(ids, start, window)
        return self._graphs.run((t, window), lambda i, s: self._forward(i, s, window), ids, start)

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on (rejected drafts)."""
        self.length = length

    def warm_up(self, width: int = 1) -> int:
        """Take one step of `width` tokens in every window the cache has, then forget them: on
        CUDA that compiles the layer parts and captures each step graph, a handful of steps where
        decoding the whole capacity would take one per position. Returns the steps taken."""
        step = window_step(self.capacity)
        ends = list(range(step, self.capacity, step)) + [self.capacity]  # each window's last slot + 1
        ids = torch.zeros(self.pad.numel(), width, dtype=torch.long, device=self.device)
        taken = 0
        for end in ends:
            if end >= width:
                self.length = end - width
                self.step(ids)
                taken += 1
        self.length = 0
        return taken

    # -- internals -------------------------------------------------------------------------

    def _forward(
        self, ids: torch.Tensor, start: torch.Tensor, window: int, prefill: bool = False, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over ids [N, T] written at slots start..start+T-1, attending to `window` slots:
        (logits [N, T, V], or [N, 1, V] for a prefill; features [N, T, L*H] or None). `rows`: the
        cache rows ids are (a prefill's group; None: all of them)."""
        m, t = self.target, ids.shape[1]
        keys, values, pad = self.keys, self.values, self.pad
        if rows is not None:  # views: the group's keys and values are written into the cache itself
            keys, values, pad = [k[rows] for k in keys], [v[rows] for v in values], pad[rows]
        slots = start + torch.arange(t, device=self.device)  # [T]
        positions = (slots[None] - pad[:, None]).clamp_min(0)  # [N, T]
        x = m.embed_tokens(ids)  # [N, T, H]
        cos, sin = rope_cos_sin(positions, m.shape.head_dim, m.shape.rope_theta, x.dtype)
        group = m.shape.num_heads // m.shape.num_kv_heads
        mask = grouped_mask(self._mask(slots, window, prefill, pad), group, self.dtype)
        wanted, feats = set(self.feature_layers), {}
        for i, layer in enumerate(m.layers):
            x = self._layers(layer, x, cos, sin, keys[i], values[i], slots, window, mask, eager=prefill)
            if i in wanted:
                feats[i] = x
        # A prefill needs the last position's logits only: the head over every prompt position would
        # be [N, P, V] in fp32 (at batch 32 x 1,500 tokens of a 152k vocabulary, 29 GB).
        logits = m.lm_head(m.norm(x[:, -1:] if prefill else x)).float()  # [N, T or 1, V]
        return logits, torch.cat([feats[i] for i in self.feature_layers], dim=-1) if feats else None

    def _mask(self, slots: torch.Tensor, window: int, prefill: bool, pad: torch.Tensor) -> torch.Tensor | None:
        """[N, 1, T, W] (True = attend): a row's own slots (after its padding `pad` [N]) up to each
        query; None when that is plain causal attention over exactly the written slots (the CPU
        path without padding)."""
        keys = torch.arange(window, device=self.device)
        causal = keys[None, :] <= slots[:, None]  # [T, W]
        if not self.graphs and not bool(pad.any()) and (prefill or slots.numel() == 1):
            return None
        mask = causal[None] & (keys[None, None, :] >= pad[:, None, None])  # [N, T, W]
        if prefill:  # a padding query sees itself: no row without keys (SDPA would give NaN)
            mask = mask | (keys[None, :] == slots[:, None])[None]
        return mask[:, None]


class CachedLayers:
    """One layer's step against its static KV cache, for the target's decoder and the drafter's:
    the work before attention, the cache write, grouped attention over the window, the work
    after it. The parts before and after attention run compiled (one graph each, shared by every
    layer of both models) or eager."""

    def __init__(self, compiled: bool):
        self.compiled = (torch.compile(before_attention), torch.compile(after_attention)) if compiled else None

    def __call__(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        window: int,
        mask: torch.Tensor | None,
        eager: bool = False,
    ) -> torch.Tensor:
        """x [N, T, H] written at `slots` [T] of keys/values [N, nkv, C, d], attending to their
        first `window` slots under a `grouped_mask` -> the layer's output [N, T, H]."""
        before, after = (before_attention, after_attention) if eager or not self.compiled else self.compiled
        q = before(layer, x, cos, sin, keys, values, slots)
        out = grouped_attention(q, keys[:, :, :window], values[:, :, :window], mask)
        return after(layer, x, out)


def make_decoder(
    target,
    batch: int,
    capacity: int,
    feature_layers: tuple[int, ...] = (),
    graphs: bool | None = None,
    compile: bool | None = None,
):
    """The KV-cached decoder for `target`: `Decoder` for the native Qwen3, target_hf.HFDecoder
    (the model's own cache, eager) for a transformers target."""
    if isinstance(target, HFTarget):
        return HFDecoder(target, batch, capacity, feature_layers)
    return Decoder(target, batch, capacity, feature_layers, graphs, compile)


def on_device(value: int, device: torch.device) -> torch.Tensor:
    """[value] as a long tensor on `device`, made there by a fill kernel: torch.tensor(..., device=)
    copies from host memory and waits for the stream to drain (a blocking copy does), which took the
    GPU's work of one step out of overlap with the host's launch of the next."""
    return torch.full((1,), value, dtype=torch.long, device=device)


def window_step(capacity: int) -> int:
    """The granularity of the attention windows of a cache of `capacity` slots under CUDA graphs."""
    return -(-capacity // (WINDOWS * WINDOW_ALIGN)) * WINDOW_ALIGN


def window_for(need: int, capacity: int, graphs: bool) -> int:
    """Slots a step attends over: exactly those written, or under graphs a multiple of window_step."""
    if not graphs:
        return need
    step = window_step(capacity)
    return min(capacity, -(-need // step) * step)


def before_attention(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """A layer's work up to attention for new tokens x [N, T, H]: their keys (RoPE applied) and
    values [N, nkv, T, d] written at `slots` [T] of keys/values [N, nkv, C, d]; the queries
    [N, nh, T, d] in the cache's dtype. Compiled, the cache write is a store of the RoPE kernel
    rather than two index_copy kernels of its own in every layer."""
    q, k, v = layer.self_attn.project(layer.input_layernorm(x))
    keys.index_copy_(2, slots, apply_rope(k, cos, sin).to(keys.dtype))
    values.index_copy_(2, slots, v.to(values.dtype))
    # Contiguous queries: grouped_attention's reshape is then a view, where it copied them for T > 1
    # (verify steps); compiled, the RoPE kernel writes this layout itself.
    return apply_rope(q, cos, sin).contiguous().to(keys.dtype)


def after_attention(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A layer's work after attention: the output projection, residuals and MLP -> [N, T, H]."""
    x = x + layer.self_attn.output(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def grouped_mask(mask: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A [N, 1, T, W] boolean mask (True = attend) repeated for the `group` query heads of a
    key-value head, as SDPA's additive mask in `dtype` (0 or -inf): [N, 1, g*T, W].

    Additive once per step because SDPA turns a boolean mask into this on every call: a kernel
    or two in each layer of every step."""
    if mask is None:
        return None
    n, _, t, w = mask.shape
    grouped = mask[:, :, None].expand(n, 1, group, t, w).reshape(n, 1, group * t, w)
    return torch.zeros(grouped.shape, dtype=dtype, device=mask.device).masked_fill_(~grouped, float("-inf"))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [N, nh, T, d] against k/v [N, nkv, W, d] (GQA) under a `grouped_mask` [N, 1, g*T, W] or
    causal (None).

    The group's query heads become extra query rows of their key-value head, [N, nkv, g*T, d], so
    that SDPA reads each cached key once instead of repeating it g times."""
    n, nh, t, d = q.shape
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
    rows = q.reshape(n, k.shape[1], -1, d)  # head h = kv * g + i
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.reshape(n, nh, t, d)  # SDPA may return another layout (fp32 on CUDA does)


def pick(
    logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Token ids from logits [..., V]: argmax at temperature 0, else a sample of the
    temperature-scaled distribution restricted to its top-p nucleus."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@torch.no_grad()
def generate(
    target: Qwen3Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    banned_ids: tuple[int, ...] = (),
    graphs: bool | None = None,
    decoder: Decoder | None = None,
) -> list[list[int]]:
    """Continue every prompt in one batch: each row's new tokens, cut after its first EOS (kept).
    Greedy at temperature 0; a row's tokens do not depend on the other rows (left padding).
    `decoder`: one to reuse (its captured graphs with it), of batch len(prompts) and room enough."""
    if not prompts or max_new_tokens < 1:
        return [[] for _ in prompts]
    if decoder is None:
        decoder = make_decoder(target, len(prompts), max(map(len, prompts)) + max_new_tokens, graphs=graphs)
    banned = torch.tensor(banned_ids, dtype=torch.long, device=decoder.device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=decoder.device)

    def choose(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
        if banned.numel():
            logits = logits.index_fill(-1, banned, float("-inf"))
        return pick(logits, temperature, top_p, generator)

    logits, _ = decoder.prefill(prompts)
    tokens = [choose(logits)]  # [N] per step
    done = torch.isin(tokens[0], eos)
    for i in range(max_new_tokens - 1):
        if i % 8 == 0 and bool(done.all()):  # a sync: not every step, so the GPU stays fed
            break
        logits, _ = decoder.step(tokens[-1][:, None])
        tokens.append(choose(logits[:, -1]))
        done |= torch.isin(tokens[-1], eos)
    rows = torch.stack(tokens, 1).tolist()  # [N, new]
    ends = set(eos_ids)
    return [row[: next((i + 1 for i, tok in enumerate(row) if tok in ends), len(row))] for row in rows]


def greedy(
    target: Qwen3Target,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    graphs: bool | None = None,
    decoder: Decoder | None = None,
) -> list[int]:
    """The target's own greedy continuation of one prompt: the lossless reference."""
    eos = () if eos_id is None else (eos_id,)
    return generate(target, [prompt], max_new_tokens, eos_ids=eos, graphs=graphs, decoder=decoder)[0]
