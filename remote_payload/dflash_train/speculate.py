"""Speculative decoding with a DFlash drafter and its target: the acceptance length a user really
gets (tau), not the teacher-forced proxy that training logs.

One loop, batch 1, greedy (lossless: the output must equal the target's own greedy decode) or
sampled (the speculative-sampling rule: the output is distributed as the target's samples):

    prefill the target on the prompt, keeping its KV cache and the drafter's context features
    repeat:
      draft   a block [last token, MASK x (B-1)] from the context features of the verified prefix
      verify  all B positions in one target forward after the cache
      accept  the longest prefix of drafts the target agrees with, plus the target's next token
      crop    the cache to the verified prefix, keep the accepted positions' features
    until EOS or max_new_tokens

tau = tokens emitted per verify step (accepted drafts + the bonus token, the last step's cut at
max_new_tokens or EOS as the output is), in two published forms (`tau_figures`): pooled over all
verify steps of all prompts (SpecForge's benchmarks), and the mean over prompts of each prompt's
tau (z-lab's benchmark.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from .decode import CachedLayers, Decoder, StepGraphs, grouped_mask, make_decoder, on_device, pick, window_for
from .model import DFlashDrafter, apply_rope, rope_cos_sin
from .sliding import draft_masks
from .target import Qwen3Target


@dataclass
class Decoded:
    """One prompt's speculative decode: the new tokens and what each verify step accepted."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step (bonus excluded)
    anchors: list[int] = field(default_factory=list)  # the anchor's position per verify step

    @property
    def emitted(self) -> int:
        """Tokens the verify steps emitted: all but the prefill's own (accepted drafts + bonuses,
        cut at max_new_tokens or EOS)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def tau(self) -> float:
        """This prompt's tokens per verify step, the bonus token included (0 without a step)."""
        return self.emitted / max(len(self.accepted), 1)


class DraftDecoder:
    """The drafter with a static cache of its context keys and values, one pair per draft layer.

    A verified position's context keys and values never change (they come from its target
    features alone), so each is projected once, when its features arrive, instead of at every
    draft over the whole context as the training forward does. Drafting a block at positions
    s..s+B-1 then writes the block's own keys and values at slots s..s+B-1 and attends to slots
    < s+B: the context before s and the whole block, the training mask for one block. Context
    from a verify step arrives for all B positions (a fixed shape) and overwrites those slots;
    the ones past the accepted run are stale and masked until the next write. On CUDA both steps
    are CUDA graphs (decode.StepGraphs) running the layers' compiled parts."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: Qwen3Target,
        capacity: int,
        graphs: bool | None = None,
        compile: bool | None = None,
    ):
        self.drafter, self.target, self.capacity = drafter, target, capacity
        self.device = target.embed_tokens.weight.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._graphs = StepGraphs(self.device) if self.graphs else None
        self._layers = CachedLayers(self.graphs if compile is None else compile)
        # As in training: fp32 drafter weights run under bf16 autocast when the target is bf16.
        self._autocast = target.embed_tokens.weight.dtype == torch.bfloat16
        self.keys: list[torch.Tensor] = []  # [1, nkv, C, d] per draft layer, made by the first context
        self.values: list[torch.Tensor] = []

    def _rope(self, slots: torch.Tensor, dtype: torch.dtype):
        shape = self.drafter.spec.shape
        return rope_cos_sin(slots[None], shape.head_dim, shape.rope_theta, dtype, shape.rope_scaling)  # [1, T, d] each

    @torch.no_grad()
    def add_context(self, features: torch.Tensor, start: int) -> None:
        """Cache the context keys/values of positions start..start+T-1 from their target
        features [1, T, L*H] (a prompt's, eagerly; a verify step's B, as a graph)."""
        t = features.shape[1]
        if start + t > self.capacity:
            raise ValueError(f"the drafter's cache is full ({self.capacity} positions)")
        first = on_device(start, self.device)
        if not self.keys or not self.graphs:
            self._context(features, first)
        else:
            self._graphs.run(("context", t), self._context, features, first)

    @torch.no_grad()
    def draft(self, last: int, start: int) -> torch.Tensor:
        """The drafter's logits [B-1, V] (fp32) for the block [last, MASK x (B-1)] at position
        `start` (the position of `last`), after the context of positions < start."""
        spec = self.drafter.spec
        block = torch.full((1, spec.block_size), spec.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0].fill_(last)  # a kernel argument: item assignment would copy from host memory and wait
        first = on_device(start, self.device)
        window = window_for(start + spec.block_size, self.capacity, self.graphs)
        if not self.graphs:
            return self._draft(block, first, window)
        return self._graphs.run(("draft", window), lambda b, f: self._draft(b, f, window), block, first)

    def _context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        d = self.drafter
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            ctx = d.hidden_norm(d.fc(features))  # [1, T, H]
            slots = start + torch.arange(features.shape[1], device=self.device)
            cos, sin = self._rope(slots, ctx.dtype)
            for i, layer in enumerate(d.layers):
                k, v = layer.self_attn.keys_values(ctx)  # [1, nkv, T, d]
                k = apply_rope(k, cos, sin)
                if len(self.keys) == i:  # the first context fixes the cache's dtype (the autocast one)
                    self.keys.append(k.new_zeros(*k.shape[:2], self.capacity, k.shape[-1]))
                    self.values.append(v.new_zeros(*v.shape[:2], self.capacity, v.shape[-1]))
                self.keys[i].index_copy_(2, slots, k.to(self.keys[i].dtype))
                self.values[i].index_copy_(2, slots, v.to(self.values[i].dtype))

    def _draft(self, block: torch.Tensor, start: torch.Tensor, window: int) -> torch.Tensor:
        d, t = self.drafter, self.target
        bs = d.spec.block_size
        slots = start + torch.arange(bs, device=self.device)  # [B]
        group = d.spec.shape.num_heads // d.spec.shape.num_kv_heads
        dtype = self.keys[0].dtype  # the cache's: SDPA wants an additive mask in the queries' dtype
        masks = {kind: grouped_mask(m, group, dtype) for kind, m in draft_masks(d.spec, start, window).items()}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            x = t.embed_tokens(block).to(self.keys[0].dtype)  # [1, B, H]
            cos, sin = self._rope(slots, x.dtype)
            for i, layer in enumerate(d.layers):
                x = self._layers(
                    layer, x, cos, sin, self.keys[i], self.values[i], slots, window, masks[d.spec.layer_type(i)]
                )
            hidden = d.norm(x)
        return t.lm_head(hidden[0, 1:].to(t.lm_head.weight.dtype)).float()  # [B-1, V]


def accept(
    drafts: torch.Tensor,
    q_logits: torch.Tensor | None,
    p_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """(accepted drafts k, the tokens emitted: those k drafts and the next token) for drafts [B-1]
    proposed from q_logits [B-1, V], with the target's p_logits [B, V] (row i predicts the token
    after block position i).

    Greedy: the drafts that equal the target's argmax, then its argmax. Sampling: the standard
    speculative-sampling rule, so that the output is distributed as the target's own samples:
    draft i stands with probability min(1, p(d_i) / q(d_i)); the first that falls is replaced by
    a sample of max(0, p - q), renormalised; if all stand, the next token is sampled from p."""
    if temperature == 0:
        # One wait for the GPU per verify step: the drafts and the target's choices come back together.
        both = torch.cat([drafts, p_logits.argmax(-1)]).tolist()
        proposed, predicted = both[: len(drafts)], both[len(drafts) :]
        k = next((i for i, (a, b) in enumerate(zip(proposed, predicted)) if a != b), len(proposed))
        return k, proposed[:k] + [predicted[k]]
    p = torch.softmax(p_logits / temperature, -1)
    q = torch.softmax(q_logits / temperature, -1)
    device = p.device
    proposed = drafts.tolist()
    for i, token in enumerate(proposed):
        ratio = p[i, token] / q[i, token].clamp_min(1e-20)
        if torch.rand((), generator=generator, device=device) >= ratio:  # rejected
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[i]
            return i, proposed[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return len(proposed), proposed + [int(torch.multinomial(p[-1], 1, generator=generator))]


def decode_room(longest_prompt: int, new_tokens: int, block_size: int) -> int:
    """Positions a verifier and drafting cache need: the prompt, the new tokens, and a block drafted
    past the end plus the one being verified."""
    return longest_prompt + new_tokens + 2 * block_size


@torch.no_grad()
def speculate(
    target: Qwen3Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    verifier: Decoder | None = None,
    drafting: DraftDecoder | None = None,
) -> Decoded:
    """Speculative decoding of one prompt (see the module docstring): greedy at temperature 0
    (lossless: the target's greedy text), else sampled with the speculative-sampling rule
    (`accept`), whose output is distributed as the target's samples at that temperature.
    `verifier` (a batch-1 Decoder with the drafter's feature layers) and `drafting`: to reuse,
    with their CUDA graphs, across prompts."""
    room = decode_room(len(prompt), max_new_tokens, drafter.spec.block_size)
    verifier = verifier or make_decoder(target, 1, room, drafter.spec.target_layer_ids)
    drafting = drafting or DraftDecoder(drafter, target, room)
    logits, context = verifier.prefill([prompt])  # [1, V], [1, P, L*H]
    drafting.add_context(context, 0)
    out = Decoded([int(pick(logits[0], temperature, generator=generator))])  # the prefill's own token
    while len(out.tokens) < max_new_tokens and out.tokens[-1] != eos_id:
        anchor = verifier.length  # position of tokens[-1]
        q_logits = drafting.draft(out.tokens[-1], anchor)  # [B-1, V]
        drafts = pick(q_logits, temperature, generator=generator)  # [B-1]
        block = torch.cat([drafts.new_full((1,), out.tokens[-1]), drafts])[None]  # made on the device
        p_logits, feats = verifier.step(block)  # [1, B, V]: predicts B tokens
        k, emitted = accept(drafts, q_logits, p_logits[0], temperature, generator)
        out.accepted.append(k)
        out.anchors.append(anchor)
        out.tokens += emitted  # accepted drafts + the bonus
        verifier.crop(anchor + k + 1)  # anchor and accepted stay cached
        drafting.add_context(feats, anchor)  # valid up to anchor + k
    if eos_id is not None and eos_id in out.tokens:
        out.tokens = out.tokens[: out.tokens.index(eos_id) + 1]
    out.tokens = out.tokens[:max_new_tokens]
    return out


def tau_figures(results: list[Decoded]) -> tuple[float, float]:
    """(pooled, per-prompt mean) tau: all emitted tokens over all verify steps of all prompts;
    the mean over prompts (with a verify step) of each prompt's own tau, as z-lab's benchmark.py
    prints it. Long, easy prompts weigh more in the pooled figure, so the two differ."""
    steps = sum(len(r.accepted) for r in results)
    decoded = [r.tau for r in results if r.accepted]
    return sum(r.emitted for r in results) / max(steps, 1), sum(decoded) / max(len(decoded), 1)


def acceptance_by_position(results: list[Decoded], block_size: int) -> list[float]:
    """For draft positions 1..B-1: the fraction of verify steps whose accepted run reached it."""
    steps = [k for r in results for k in r.accepted]
    return [sum(k >= i for k in steps) / max(len(steps), 1) for i in range(1, block_size)]


def held_out_prompts(seqs: list[tuple[torch.Tensor, torch.Tensor]], count: int, length: int) -> list[list[int]]:
    """Up to `count` prompts from held-out (input_ids, loss_mask) sequences: the tokens before the
    first supervised one (a chat row's prompt), else the first `length` tokens."""
    prompts: list[list[int]] = []
    for ids, mask in seqs:
        if len(prompts) >= count:
            break
        supervised = torch.nonzero(mask).flatten()
        cut = int(supervised[0]) if len(supervised) and int(supervised[0]) > 0 else length
        if 0 < cut < len(ids):
            prompts.append([int(t) for t in ids[:cut]])
    return prompts


def speculative_eval(target: Qwen3Target, drafter: DFlashDrafter, prompts: list[list[int]], new_tokens: int) -> dict:
    """tau (pooled `spec_tau`, per-prompt mean `spec_tau_prompt_mean`) and acceptance per draft
    position over prompts, decoded greedily. The drafter's
    compiled layers run eagerly here (its shapes change every step: no recompiles), and the
    target's decode steps are not compiled (no compile in the middle of training)."""
    room = decode_room(max(map(len, prompts)), new_tokens, drafter.spec.block_size)
    verifier = make_decoder(target, 1, room, drafter.spec.target_layer_ids, compile=False)
    drafting = DraftDecoder(drafter, target, room, compile=False)
    with torch.compiler.set_stance("force_eager"):
        results = [speculate(target, drafter, p, new_tokens, verifier=verifier, drafting=drafting) for p in prompts]
    steps = sum(len(r.accepted) for r in results)
    pooled, per_prompt = tau_figures(results)
    taus = [r.tau for r in results if r.accepted]
    # The spread of the per-prompt mean: its standard error over prompts (0 with one prompt).
    se = statistics.stdev(taus) / math.sqrt(len(taus)) if len(taus) > 1 else 0.0
    return {
        "spec_tau": pooled,
        "spec_tau_prompt_mean": per_prompt,
        "spec_tau_prompt_se": se,
        "spec_by_position": acceptance_by_position(results, drafter.spec.block_size),
        "spec_prompts": len(prompts),
        "spec_steps": steps,
    }
