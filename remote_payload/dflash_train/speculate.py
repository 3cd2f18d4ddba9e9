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

tau = mean tokens emitted per verify step (accepted drafts + the bonus token), as z-lab's
benchmark and SpecForge report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decode import Decoder, pick
from .model import DFlashDrafter, block_mask
from .target import Qwen3Target


@dataclass
class Decoded:
    """One prompt's speculative decode: the new tokens and what each verify step accepted."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step (bonus excluded)
    anchors: list[int] = field(default_factory=list)  # the anchor's position per verify step

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus token included."""
        return sum(k + 1 for k in self.accepted) / max(len(self.accepted), 1)


@torch.no_grad()
def draft_logits(drafter: DFlashDrafter, target: Qwen3Target, context: torch.Tensor, last: int,
                 attention: str = "dense") -> torch.Tensor:
    """The drafter's logits [B-1, V] (fp32) for the B-1 positions after `last`, from the context
    features [1, S, L*H] of the S verified positions before it."""
    spec = drafter.spec
    s, bs = context.shape[1], spec.block_size
    device = context.device
    block = torch.full((1, bs), spec.mask_token_id, dtype=torch.long, device=device)
    block[0, 0] = last
    anchors = torch.tensor([[s]], device=device)                                  # the block sits at S..S+B-1
    # As in training: the drafter's fp32 weights under bf16 autocast when the target runs in bf16.
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=context.dtype == torch.bfloat16):
        hidden = drafter(context, target.embed_tokens(block), anchors, block_mask(anchors, s, bs, attention))
    return target.lm_head(hidden[0, 1:].to(target.lm_head.weight.dtype)).float()  # [B-1, V]


def accept(drafts: torch.Tensor, q_logits: torch.Tensor, p_logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted drafts k, the next token) for drafts [B-1] proposed from q_logits [B-1, V], with
    the target's p_logits [B, V] (row i predicts the token after block position i).

    Greedy: the drafts that equal the target's argmax, then its argmax. Sampling: the standard
    speculative-sampling rule, so that the output is distributed as the target's own samples:
    draft i stands with probability min(1, p(d_i) / q(d_i)); the first that falls is replaced by
    a sample of max(0, p - q), renormalised; if all stand, the next token is sampled from p."""
    if temperature == 0:
        predicted = p_logits.argmax(-1)
        k = int((predicted[:-1] == drafts).long().cumprod(0).sum())
        return k, int(predicted[k])
    p = torch.softmax(p_logits / temperature, -1)
    q = torch.softmax(q_logits / temperature, -1)
    device = p.device
    for i, token in enumerate(drafts.tolist()):
        ratio = p[i, token] / q[i, token].clamp_min(1e-20)
        if torch.rand((), generator=generator, device=device) >= ratio:  # rejected
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.no_grad()
def speculate(target: Qwen3Target, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int,
              eos_id: int | None = None, attention: str = "dense", temperature: float = 0.0,
              generator: torch.Generator | None = None, verifier: Decoder | None = None) -> Decoded:
    """Speculative decoding of one prompt (see the module docstring): greedy at temperature 0
    (lossless: the target's greedy text), else sampled with the speculative-sampling rule
    (`accept`), whose output is distributed as the target's samples at that temperature.
    `verifier`: a batch-1 Decoder with the drafter's feature layers to reuse (and its graphs)."""
    device = next(target.parameters()).device
    block_size = drafter.spec.block_size
    if verifier is None:
        verifier = Decoder(target, 1, len(prompt) + max_new_tokens + block_size, drafter.spec.target_layer_ids)
    logits, context = verifier.prefill([prompt])                                  # [1, V], [1, P, L*H]
    out = Decoded([int(pick(logits[0], temperature, generator=generator))])      # the prefill's own token
    while len(out.tokens) < max_new_tokens and out.tokens[-1] != eos_id:
        anchor = verifier.length                                                  # position of tokens[-1]
        q_logits = draft_logits(drafter, target, context, out.tokens[-1], attention)
        drafts = pick(q_logits, temperature, generator=generator)                # [B-1]
        block = torch.cat([torch.tensor([out.tokens[-1]], device=device), drafts])[None]
        p_logits, feats = verifier.step(block)                                    # [1, B, V]: predicts B tokens
        k, following = accept(drafts, q_logits, p_logits[0], temperature, generator)
        out.accepted.append(k)
        out.anchors.append(anchor)
        out.tokens += [int(t) for t in drafts[:k]] + [following]                  # accepted drafts + the bonus
        verifier.crop(anchor + k + 1)                                             # anchor and accepted stay cached
        context = torch.cat([context, feats[:, :k + 1]], dim=1)
    if eos_id is not None and eos_id in out.tokens:
        out.tokens = out.tokens[:out.tokens.index(eos_id) + 1]
    out.tokens = out.tokens[:max_new_tokens]
    return out


def acceptance_by_position(results: list[Decoded], block_size: int) -> list[float]:
    """For draft positions 1..B-1: the fraction of verify steps whose accepted run reached it."""
    steps = [k for r in results for k in r.accepted]
    return [sum(k >= i for k in steps) / max(len(steps), 1) for i in range(1, block_size)]


def held_out_prompts(seqs: list[tuple[torch.Tensor, torch.Tensor]], count: int, length: int) -> list[list[int]]:
    """Up to `count` prompts from held-out (input_ids, loss_mask) sequences: the tokens before the
    first supervised one (a chat row's prompt), else the first `length` tokens."""
    prompts = []
    for ids, mask in seqs:
        supervised = torch.nonzero(mask).flatten()
        cut = int(supervised[0]) if len(supervised) and int(supervised[0]) > 0 else length
        if 0 < cut < len(ids):
            prompts.append([int(t) for t in ids[:cut]])
        if len(prompts) == count:
            break
    return prompts


def speculative_eval(target: Qwen3Target, drafter: DFlashDrafter, prompts: list[list[int]],
                     new_tokens: int) -> dict:
    """tau and acceptance per draft position over prompts, decoded greedily. The drafter's
    compiled layers run eagerly here (its shapes change every step: no recompiles), and the
    target's decode steps are not compiled (no compile in the middle of training)."""
    block = drafter.spec.block_size
    verifier = Decoder(target, 1, max(map(len, prompts)) + new_tokens + block, drafter.spec.target_layer_ids,
                       compile=False)
    with torch.compiler.set_stance("force_eager"):
        results = [speculate(target, drafter, p, new_tokens, verifier=verifier) for p in prompts]
    steps = sum(len(r.accepted) for r in results)
    return {"spec_tau": sum(k + 1 for r in results for k in r.accepted) / max(steps, 1),
            "spec_by_position": acceptance_by_position(results, drafter.spec.block_size),
            "spec_prompts": len(prompts), "spec_steps": steps}
