"""Prompt lookup, the free baseline of `dflashctl eval` (lookup.py, issue 26): the n-gram matcher's
proposals, its decode on the target's own path (lossless), and the two published tau figures."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.decode import Decoder, greedy
from dflash_train.lookup import NgramIndex, lookup_decode, lookup_eval, prompt_lookup
from dflash_train.replica import build_target
from dflash_train.plan import resolve_run
from dflash_train.speculate import Decoded, tau_figures


def test_the_proposal_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    # (1, 2) occurred at 0 (then 3) and at 4 (then 5): the latest wins (transformers takes the earliest).
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 5, 1, 2], 3) == [5, 1, 2]
    # Past the end of the text the copy repeats what it copied, as a repeat would: period 3.
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 5, 1, 2], 5) == [5, 1, 2, 5, 1]
    # The 3-gram (1, 2, 3) occurred (then 5); the 2-gram (2, 3) later (then 9): the longer match wins.
    assert prompt_lookup([4, 1, 2, 3, 5, 2, 3, 9, 1, 2, 3], 3) == [5, 2, 3]
    # With 1-grams only, the latest earlier 3 (then 9, 1, 2, 3, and again).
    assert prompt_lookup([4, 1, 2, 3, 5, 2, 3, 9, 1, 2, 3], 6, max_ngram=1) == [9, 1, 2, 3, 9, 1]
    assert prompt_lookup([5, 5], 3) == [5, 5, 5]
    assert prompt_lookup([1, 2, 3], 4) == [] and prompt_lookup([], 4) == []
    with pytest.raises(ValueError):
        NgramIndex(0)


def naive_proposal(tokens: list[int], k: int, max_ngram: int) -> list[int]:
    """The definition, by scanning: the latest i < end - n whose n tokens equal the last n."""
    end = len(tokens)
    for n in range(min(max_ngram, end), 0, -1):
        for i in range(end - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[end - n :]:
                copied = list(tokens)
                for j in range(k):
                    copied.append(copied[i + n + j])
                return copied[end:]
    return []


def test_the_incremental_index_proposes_what_a_scan_of_the_whole_text_finds():
    rng = random.Random(0)
    for max_ngram in (1, 2, 3):
        tokens = [rng.randrange(4) for _ in range(300)]
        index = NgramIndex(max_ngram)
        for t, token in enumerate(tokens):
            assert index.propose(5) == naive_proposal(tokens[:t], 5, max_ngram), (max_ngram, t)
            index.extend([token])


def test_tau_pooled_and_mean_per_prompt_on_known_runs():
    runs = [
        Decoded([9] * 6, accepted=[3, 0]),  # 5 tokens after the prefill's in 2 steps: tau 2.5
        Decoded([9] * 5, accepted=[0, 0, 0, 0]),  # 4 in 4: tau 1.0
        Decoded([9] * 4, accepted=[7]),  # 8 accepted, cut to max_new_tokens 4: 3 in 1 step
        Decoded([2], accepted=[]),  # the prefill's token was EOS: no step, no tau
    ]
    assert [r.tau for r in runs] == [2.5, 1.0, 3.0, 0.0]
    pooled, mean = tau_figures(runs)
    assert pooled == pytest.approx(12 / 7) and mean == pytest.approx((2.5 + 1.0 + 3.0) / 3)


@pytest.fixture(scope="module")
def target():
    cfg = resolve_run(load_config(preset="tiny")).cfg
    return build_target(cfg, torch.device("cpu")).eval()


PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 40)), [3, 9, 3, 9, 3, 9, 11, 12, 13]]


def test_prompt_lookup_decodes_the_targets_greedy_text_in_fewer_steps(target):
    decoder = Decoder(target, 1, 64 + 48 + 8)  # one decoder for every prompt, as eval reuses it
    for prompt in PROMPTS:
        out = lookup_decode(target, prompt, 48, 7, decoder=decoder)
        assert out.tokens == greedy(target, prompt, 48)  # lossless
        assert len(out.accepted) == len(out.anchors) and all(0 <= k <= 7 for k in out.accepted)
    # A repetitive prompt: the target's greedy text repeats too, and the copies are accepted.
    out = lookup_decode(target, PROMPTS[0], 48, 7)
    assert out.tau > 1.5 and max(out.accepted) == 7


def test_lookup_eval_reports_both_taus(target):
    figures = lookup_eval(target, PROMPTS, 32, 7)
    assert figures["lookup_prompts"] == 3 and figures["lookup_tokens"] == 7 and figures["lookup_steps"] > 0
    assert 1.0 < figures["lookup_tau"] <= 8 and 1.0 < figures["lookup_tau_prompt_mean"] <= 8
    runs = [lookup_decode(target, p, 32, 7) for p in PROMPTS]
    assert (figures["lookup_tau"], figures["lookup_tau_prompt_mean"]) == pytest.approx(tau_figures(runs))
