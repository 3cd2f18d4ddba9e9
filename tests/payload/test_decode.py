"""The one KV-cached decode path (decode.py) on the tiny target, on the CPU: batched, left-padded
generation against full recomputation, a multi-token step against one token at a time, cropping,
EOS, banned ids and nucleus sampling."""

from __future__ import annotations

import pytest
import torch

from dflash_train.config import TargetConfig
from dflash_train import decode
from dflash_train.decode import WINDOW_ALIGN, WINDOWS, Decoder, generate, greedy, pick, window_for, window_step
from dflash_train.model import DFlashDrafter, DrafterSpec
from dflash_train.speculate import DraftDecoder
from dflash_train.target import build_tiny_target

TARGET = build_tiny_target(TargetConfig(), seed=0)


def recomputed_greedy(prompt: list[int], new: int, banned: int | None = None) -> list[int]:
    """Greedy continuation by re-running the whole causal forward for every token."""
    ids = torch.tensor([prompt])
    for _ in range(new):
        logits = TARGET.logits(ids)[0, -1]
        if banned is not None:
            logits[banned] = float("-inf")
        ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
    return ids[0, len(prompt) :].tolist()


def test_a_left_padded_batch_decodes_each_row_as_alone():
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 511, (n,), generator=gen).tolist() for n in (5, 9, 1, 14)]
    batch = generate(TARGET, prompts, 12, banned_ids=(511,))
    for prompt, row in zip(prompts, batch):
        assert row == recomputed_greedy(prompt, 12, banned=511)
    assert greedy(TARGET, prompts[1], 12) == recomputed_greedy(prompts[1], 12)


def test_a_block_step_after_the_cache_equals_one_token_at_a_time_and_crop_forgets():
    prompt, more = [[3, 1, 4, 1, 5, 9, 2, 6]], [5, 9, 11, 3]
    one, many = Decoder(TARGET, 1, 32, (1, 2)), Decoder(TARGET, 1, 32, (1, 2))
    one.prefill(prompt)
    many.prefill(prompt)
    steps = [one.step(torch.tensor([[t]])) for t in more]
    block_logits, block_feats = many.step(torch.tensor([more]))
    torch.testing.assert_close(block_logits[0], torch.cat([s[0][0] for s in steps]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block_feats, torch.cat([s[1] for s in steps], 1), rtol=1e-5, atol=1e-5)
    # Crop two positions away and write different tokens there: as if the first two were all.
    many.crop(len(prompt[0]) + 2)
    again, _ = many.step(torch.tensor([[7, 8]]))
    fresh = Decoder(TARGET, 1, 32)
    fresh.prefill([prompt[0] + more[:2]])
    expected, _ = fresh.step(torch.tensor([[7, 8]]))
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


def test_a_prefill_runs_the_head_on_each_rows_last_position_only():
    """A prompt's logits are needed at its end alone: the head over every position would be [N, P, V]
    in fp32 (29 GB at batch 32 x 1,500 tokens of Qwen3's vocabulary)."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2]]
    heads = []
    hook = TARGET.lm_head.register_forward_hook(lambda _m, args, _out: heads.append(tuple(args[0].shape)))
    try:
        last, feats = Decoder(TARGET, 2, 32, (1,)).prefill(prompts)
    finally:
        hook.remove()
    assert heads == [(2, 1, TARGET.cfg.hidden_size)] and feats.shape[:2] == (2, 8)
    for row, prompt in zip(last, prompts):
        torch.testing.assert_close(row, TARGET.logits(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5)


def test_a_prefill_in_row_groups_fills_the_cache_as_one_forward_would(monkeypatch):
    """A long prefill runs its rows in groups of PREFILL_TOKENS prompt tokens (bounded activations at
    any batch): the same logits, features, cache and continuation as one forward over every row."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 511, (n,), generator=gen).tolist() for n in (9, 4, 1, 9, 6)]
    whole = Decoder(TARGET, 5, 40, (1, 2))
    one_logits, one_feats = whole.prefill(prompts)
    monkeypatch.setattr(decode, "PREFILL_TOKENS", 18)  # 9-token prompts: groups of 2 rows, 2 and 1
    heads = []
    hook = TARGET.lm_head.register_forward_hook(lambda _m, args, _out: heads.append(args[0].shape[0]))
    try:
        grouped = Decoder(TARGET, 5, 40, (1, 2))
        logits, feats = grouped.prefill(prompts)
    finally:
        hook.remove()
    assert heads == [2, 2, 1] and grouped.length == whole.length == 9
    torch.testing.assert_close(logits, one_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, one_feats, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grouped.keys + grouped.values, whole.keys + whole.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert generate(TARGET, prompts, 8, decoder=grouped) == generate(TARGET, prompts, 8)


def test_a_warmed_up_decoder_takes_a_step_per_window_and_then_decodes_as_a_fresh_one():
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    decoder = Decoder(TARGET, 2, 600)  # windows end at 64, 128, ..., 576 and 600
    assert decoder.warm_up() == 10 and decoder.length == 0
    assert decoder.warm_up(width=300) == 6  # no window ends before a 300-token step fits (320 on)
    assert generate(TARGET, prompts, 10, decoder=decoder) == generate(TARGET, prompts, 10)


@pytest.mark.parametrize("capacity", [1, 63, 64, 600, 1024, 1025, 4096, 40960, 131072])
def test_graph_windows_are_few_aligned_and_cover_every_step(capacity):
    windows = {window_for(need, capacity, graphs=True) for need in range(1, capacity + 1)}
    assert len(windows) <= WINDOWS and max(windows) == capacity
    assert all(w % WINDOW_ALIGN == 0 for w in windows - {capacity})
    for need in (1, capacity // 2 + 1, capacity):  # each step sees its slots, and under a step's rounding more
        assert need <= window_for(need, capacity, graphs=True) < need + window_step(capacity)
    assert window_for(capacity // 2 + 1, capacity, graphs=False) == capacity // 2 + 1


def test_rows_stop_after_their_eos_and_the_batch_stops_when_all_have():
    prompt = [2, 7, 1, 8]
    free = recomputed_greedy(prompt, 10)
    eos = free[3]
    out = generate(TARGET, [prompt, [9, 9]], 10, eos_ids=(eos,))
    assert out[0] == free[: free.index(eos) + 1]
    assert eos not in out[1][:-1]


def test_nucleus_sampling_keeps_only_the_top_p_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    draws = pick(logits.expand(4000, 4), temperature=1.0, top_p=0.7, generator=gen)
    counts = torch.bincount(draws, minlength=4).float() / 4000
    assert counts[2:].sum() == 0  # outside the nucleus {0, 1}
    assert abs(float(counts[0]) - 0.5 / 0.8) < 0.03  # renormalised within it (4000 draws: sd ~0.008)
    assert torch.equal(pick(logits, 0.0), torch.tensor(0))


def test_a_difference_from_the_reference_is_located_and_weighed():
    """eval's check: where the speculative output parts from greedy, the target's logit gap there."""
    from dflash_train.evaluate import first_difference

    prompt = [4, 8, 15, 16]
    reference = greedy(TARGET, prompt, 6)
    assert first_difference(TARGET, prompt, reference, list(reference)) is None
    logits = TARGET.logits(torch.tensor([prompt + reference[:2]]))[0, -1]
    worst = int(logits.argmin())
    found = first_difference(TARGET, prompt, reference, reference[:2] + [worst] + reference[3:])
    assert found["index"] == 2 and found["speculative"] == worst and found["tie"] is False
    assert found["logit_gap"] == pytest.approx(float(logits.max() - logits.min()), rel=1e-5)
    assert (found["reference_logit"], found["speculative_logit"]) == pytest.approx(
        (float(logits.max()), float(logits.min())), rel=1e-5
    )
    assert first_difference(TARGET, prompt, reference, reference[:4])["tie"] is False  # stopped early


def test_a_tie_in_bf16_scales_with_the_logits_magnitude():
    """4 bf16 ulps at the larger logit's magnitude (0.25 up to |logit| 8); fp32 stays exact-ish."""
    from dflash_train.evaluate import tie_tolerance

    assert tie_tolerance(torch.bfloat16, 3.0) == tie_tolerance(torch.bfloat16, -8.0) == 0.25
    assert tie_tolerance(torch.bfloat16, 16.0) == 0.5
    assert tie_tolerance(torch.bfloat16, -40.0) == 1.25
    assert tie_tolerance(torch.float32, 40.0) == 1e-4


@pytest.mark.slow
def test_compiled_steps_decode_the_same_tokens_as_eager():
    """The compiled parts of a step (what a GPU runs, there inside CUDA graphs) against eager."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    compiled = Decoder(TARGET, 2, 32, compile=True)
    assert generate(TARGET, prompts, 10, decoder=compiled) == generate(TARGET, prompts, 10)
    compiled.prefill(prompts)
    eager = Decoder(TARGET, 2, 32)
    eager.prefill(prompts)
    block = torch.tensor([[5, 9, 11, 3], [2, 7, 1, 8]])
    torch.testing.assert_close(compiled.step(block)[0], eager.step(block)[0], rtol=1e-4, atol=1e-4)
    # The drafter's compiled draft step (its layers' parts share the target's compiled functions).
    spec = DrafterSpec(TARGET.shape, 2, 4, (1, 3), 511)
    drafter = DFlashDrafter(spec)
    drafter.init_weights(0.02, seed=0)
    feats = TARGET.features(torch.tensor([prompts[0]]), spec.target_layer_ids)
    drafts = []
    for flag in (True, False):
        drafting = DraftDecoder(drafter, TARGET, 16, compile=flag)
        drafting.add_context(feats, 0)
        drafts.append(drafting.draft(7, len(prompts[0])))
    torch.testing.assert_close(drafts[0], drafts[1], rtol=1e-4, atol=1e-4)
