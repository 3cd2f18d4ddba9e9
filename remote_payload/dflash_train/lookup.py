"""Prompt-lookup speculative decoding: the free baseline a trained drafter has to beat.

The proposals come from the text itself (prompt + tokens generated so far), as transformers'
`prompt_lookup_num_tokens` makes them: the last n tokens (n from `max_ngram` down to 1) are
looked up among earlier positions and the tokens that followed them are proposed, up to k. Two
choices differ from transformers: the latest earlier occurrence is taken (transformers takes the
earliest), and a copy that reaches the end of the text continues over its own proposal, as a
repeat would (transformers stops there). Nothing is trained and nothing runs on the device to
propose: the search is a dictionary look-up on the host.

The proposals are verified on the drafter's own decode path (decode.Decoder: the same target,
static KV cache, verify step and, on CUDA, graphs), greedily, so the output is the target's own
greedy text. tau is counted as for the drafter (speculate.tau_figures).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from .decode import Decoder, make_decoder
from .speculate import Decoded, accept, tau_figures
from .target import Qwen3Target

MAX_NGRAM = 3  # the longest suffix looked up (transformers' max_matching_ngram_size defaults to 2)


class NgramIndex:
    """A growing token list with, for every n-gram (n <= max_ngram) that has a follower, the
    position right after its latest occurrence. Appending a token costs O(max_ngram) and a
    proposal O(max_ngram + k), whatever the text's length (a scan would cost O(length) per step)."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (verified text only: a rejected proposal never enters the index)."""
        for token in tokens:
            t = len(self.tokens)  # every n-gram ending at t - 1 gets its follower now
            for n in range(1, min(self.max_ngram, t) + 1):
                self._after[tuple(self.tokens[t - n : t])] = t
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the text's last n tokens, the
        longest n that occurred before; [] when not even the last token did."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), 0, -1):
            start = self._after.get(tuple(self.tokens[end - n :]))
            if start is not None:
                period = end - start  # past the end, the copy repeats tokens[start:end]
                return [self.tokens[start + i % period] for i in range(k)]
        return []


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The proposal (k tokens or none) for a whole token list, from scratch: see NgramIndex.propose."""
    index = NgramIndex(max_ngram)
    index.extend(tokens)
    return index.propose(k)


@torch.no_grad()
def lookup_decode(
    target: Qwen3Target,
    prompt: list[int],
    max_new_tokens: int,
    num_tokens: int,
    max_ngram: int = MAX_NGRAM,
    eos_id: int | None = None,
    decoder: Decoder | None = None,
) -> Decoded:
    """Greedy prompt-lookup speculative decoding of one prompt: each verify step checks the
    `num_tokens` proposed tokens (if any) in one target forward and keeps those the target
    agrees with plus its next token, so the output is the target's greedy text. `decoder`: a
    batch-1 Decoder with room for the prompt, the new tokens and one block of num_tokens + 1, to
    reuse (with its CUDA graphs) across prompts and with the drafter's loop."""
    device = target.embed_tokens.weight.device
    decoder = decoder or make_decoder(target, 1, len(prompt) + max_new_tokens + num_tokens + 1)
    logits, _ = decoder.prefill([prompt])
    out = Decoded([int(logits[0].argmax())])
    index = NgramIndex(max_ngram)
    index.extend(prompt + out.tokens)
    while len(out.tokens) < max_new_tokens and out.tokens[-1] != eos_id:
        anchor = decoder.length
        # Two step shapes only (one CUDA graph each per window): a block of num_tokens + 1, the
        # drafter's verify step when num_tokens = its block - 1, or, with nothing found, a plain
        # decode step.
        proposed = index.propose(num_tokens)
        block = torch.tensor([[out.tokens[-1]] + proposed], device=device)
        p_logits, _ = decoder.step(block)
        k, new = accept(block[0, 1:], None, p_logits[0], 0.0, None)
        out.accepted.append(k)
        out.anchors.append(anchor)
        out.tokens += new
        index.extend(new)
        decoder.crop(anchor + k + 1)
    if eos_id is not None and eos_id in out.tokens:
        out.tokens = out.tokens[: out.tokens.index(eos_id) + 1]
    out.tokens = out.tokens[:max_new_tokens]
    return out


def _eager():
    """Compiled code (a compiled step's target layers) runs eager here. Without Dynamo imported
    nothing was compiled: skip set_stance, whose import of Dynamo costs ~1.5 s of CPU."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def lookup_eval(
    target: Qwen3Target, prompts: list[list[int]], new_tokens: int, num_tokens: int, max_ngram: int = MAX_NGRAM
) -> dict:
    """Prompt lookup's tau over prompts, greedy, in the keys speculate.speculative_eval uses for
    the drafter (with `lookup_` for `spec_`): the baseline to compare a drafter's figures with."""
    room = max(map(len, prompts)) + new_tokens + num_tokens + 1
    decoder = make_decoder(target, 1, room, compile=False)
    with _eager():
        results = [lookup_decode(target, p, new_tokens, num_tokens, max_ngram, decoder=decoder) for p in prompts]
    pooled, per_prompt = tau_figures(results)
    return {
        "lookup_tau": pooled,
        "lookup_tau_prompt_mean": per_prompt,
        "lookup_prompts": len(prompts),
        "lookup_steps": sum(len(r.accepted) for r in results),
        "lookup_tokens": num_tokens,
    }
