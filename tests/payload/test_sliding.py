"""Sliding-window drafter layers (sliding.py, issue 27 item 4): the mask against brute force, flex
against dense, a short training run, the cached decode against the training forward, lossless
speculation, and the export in the published layout (`layer_types`, `sliding_window`) loaded
strictly by the shipped transformers model with the same hidden states (both its forwards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.config import Config, ConfigError, load_config
from dflash_train.data import BlockSampler, build_datasets
from dflash_train.decode import greedy
from dflash_train.model import attend, block_input_ids
from dflash_train.replica import build_replica, forward_loss, train_step
from dflash_train.plan import resolve_run
from dflash_train.resolve import drafter_spec
from dflash_train.resolve import check_layer_types
from dflash_train.sliding import dense_sliding_mask, drafter_masks, flex_sliding_mask
from dflash_train.speculate import DraftDecoder, speculate


def resolved(cfg: Config, notes: list[str] | None = None) -> Config:
    """The config as the run plan fills it on a machine without CUDA (its decisions' lines into `notes`)."""
    plan = resolve_run(cfg, cuda_count=0)
    if notes is not None:
        notes.extend(plan.notes)
    return plan.cfg


pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
WINDOW = 3  # the trained drafter's: well inside the 8-token prompts
MASK_WINDOW = 5
TYPES = ["sliding_attention", "full_attention"]


def test_the_sliding_mask_matches_brute_force():
    anchors = torch.tensor([[0, 3, 9], [2, 6, 11]])
    seq_len, bs = 14, 4
    mask = dense_sliding_mask(anchors, seq_len, bs, MASK_WINDOW)
    n, a = anchors.shape
    q = a * bs
    assert mask.shape == (n, 1, q, q + seq_len)
    for b in range(n):
        for qi in range(q):
            blk, pos = qi // bs, anchors[b, qi // bs].item() + qi % bs
            for kv in range(q + seq_len):
                if kv < q:
                    expected = kv // bs == blk  # own block, bidirectional
                else:
                    expected = kv - q < anchors[b, blk].item() and pos - (kv - q) < MASK_WINDOW
                assert mask[b, 0, qi, kv].item() == expected, (b, qi, kv)
    ctx = mask[:, 0, :, q:]
    assert not ctx[1, 8 + 3, :6].any() and ctx[1, 8, 7:11].all()  # the window bites: block 2 at 11


def test_flex_and_dense_sliding_attention_agree():
    torch.manual_seed(0)
    anchors = torch.tensor([[1, 6, 12], [0, 9, 10]])
    seq_len, bs = 16, 4
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, seq_len + 12, 8), torch.randn(2, 2, seq_len + 12, 8)
    dense = attend(q, k, v, dense_sliding_mask(anchors, seq_len, bs, MASK_WINDOW))
    flex = attend(q, k, v, flex_sliding_mask(anchors, seq_len, bs, MASK_WINDOW))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "types,window,message",
    [
        (["full_attention"], None, r"lists 1 layer\(s\) for a drafter of 2"),
        (["full_attention", "local"], 4, "'local' is not full_attention or sliding_attention"),
        (TYPES, None, "set drafter.sliding_window"),
    ],
)
def test_layer_types_that_do_not_fit_are_config_errors(types, window, message):
    with pytest.raises(ConfigError, match=message):
        check_layer_types(types, window, 2)


def test_all_full_layers_are_the_plain_drafter():
    assert check_layer_types(["full_attention"] * 2, 8, 2) == ()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny drafter of one sliding and one full layer, trained briefly on the demo data; the
    loss on a fixed batch before and after."""
    out = tmp_path_factory.mktemp("sliding") / "run"
    plan = resolve_run(
        load_config(
            preset="tiny",
            overrides=[
                f"run.output_dir={out}",
                "drafter.num_layers=2",
                f"drafter.layer_types={json.dumps(TYPES)}",
                f"drafter.sliding_window={WINDOW}",
            ],
        ),
        cuda_count=0,
    )
    cfg = plan.cfg
    train, held_out = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    replica = build_replica(cfg, "cpu", cfg.run.seed, plan.policy)
    batch = sampler.batch(0)
    before = forward_loss(replica, batch).loss.item()
    for step in range(60):
        train_step(replica, sampler.batch(step))
    after = forward_loss(replica, batch).loss.item()
    prompts = [[int(t) for t in ids[: cfg.data.prompt_length]] for ids, _ in (held_out + train)[:4]]
    return cfg, replica, prompts, (before, after)


def test_training_with_sliding_layers_lowers_the_loss(trained):
    cfg, replica, _, (before, after) = trained
    assert replica.drafter.spec.layer_types == tuple(TYPES) and replica.drafter.spec.sliding_window == WINDOW
    assert after < 0.8 * before


def forward_at(replica, ids, feats, anchor: int, sliding: bool = True) -> torch.Tensor:
    """The training forward's hidden states for one block at `anchor` over the context before it."""
    spec = replica.drafter.spec
    anchors = torch.tensor([[anchor]])
    embeds = replica.target.embed_tokens(block_input_ids(ids, anchors, spec.block_size, spec.mask_token_id))
    masks = drafter_masks(anchors, anchor, spec, "dense")
    if not sliding:
        masks = masks["full_attention"]
    with torch.no_grad():
        return replica.drafter(feats[:, :anchor], embeds, anchors, masks)


def test_the_cached_drafter_drafts_what_the_training_forward_drafts(trained):
    """DraftDecoder's bounded context in the sliding layer = the training mask, at anchors well
    past the window (where a full layer would see more)."""
    _, replica, prompts, _ = trained
    spec = replica.drafter.spec
    block = spec.block_size
    sequence = prompts[0] + greedy(replica.target, prompts[0], 3 * block)
    ids = torch.tensor([sequence])
    feats = replica.target.features(ids, spec.target_layer_ids)
    drafting = DraftDecoder(replica.drafter, replica.target, len(sequence) + block)
    anchor = len(prompts[0])
    assert anchor > WINDOW + 1
    drafting.add_context(feats[:, :anchor], 0)
    for accepted in (2, 0, 5):
        hidden = forward_at(replica, ids, feats, anchor)
        torch.testing.assert_close(
            drafting.draft(sequence[anchor], anchor), replica.target.lm_head(hidden[0, 1:]), rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(hidden, forward_at(replica, ids, feats, anchor, sliding=False))  # the window bites
        drafting.add_context(feats[:, anchor : anchor + block], anchor)
        anchor += accepted + 1


def test_greedy_speculation_with_sliding_layers_is_lossless(trained):
    _, replica, prompts, _ = trained
    for prompt in prompts:
        assert speculate(replica.target, replica.drafter, prompt, 30).tokens == greedy(replica.target, prompt, 30)


def test_the_export_has_the_published_layout_and_loads_strictly_with_the_same_states(trained, tmp_path):
    """config.json carries `layer_types` and `sliding_window` as z-lab's drafters publish them;
    `AutoModel.from_pretrained(export, trust_remote_code=True)` loads every tensor (none missing
    or unexpected), and both its forwards (the trainer's `block_forward`; z-lab's, with the
    context in pieces through a transformers cache) give the trainer's hidden states."""
    transformers = pytest.importorskip("transformers")
    from dflash_train.export import export_drafter, load_exported

    cfg, replica, prompts, _ = trained
    out = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"], config["use_sliding_window"]) == (TYPES, WINDOW, True)
    assert load_exported(out)[0].spec == replica.drafter.spec
    loaded, info = transformers.AutoModel.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert repr(loaded.spec) == repr(replica.drafter.spec)  # the export carries its own copy of the class
    spec, block = replica.drafter.spec, cfg.drafter.block_size
    ids = torch.tensor([prompts[0] + prompts[1]])
    feats = replica.target.features(ids, spec.target_layer_ids)
    anchors = torch.tensor([[3, 14]])
    embeds = replica.target.embed_tokens(block_input_ids(ids, anchors, block, spec.mask_token_id))
    masks = drafter_masks(anchors, ids.shape[1], spec, "dense")
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.block_forward(feats, embeds, anchors, masks), replica.drafter(feats, embeds, anchors, masks)
        )
    cache, done = transformers.DynamicCache(), 0
    for anchor in (5, 6, 13, ids.shape[1] - 1):  # context in pieces, past the window
        block_ids = block_input_ids(ids, torch.tensor([[anchor]]), block, spec.mask_token_id)
        embeds = replica.target.embed_tokens(block_ids)
        with torch.no_grad():
            theirs = loaded(
                position_ids=torch.arange(done, anchor + block)[None],
                noise_embedding=embeds,
                target_hidden=feats[:, done:anchor],
                past_key_values=cache,
                use_cache=True,
            )
        cache.crop(-block)
        torch.testing.assert_close(theirs, forward_at(replica, ids, feats, anchor), rtol=1e-5, atol=1e-5)
        done = anchor


def test_the_resolved_spec_carries_the_layer_types():
    cfg = resolved(
        load_config(
            overrides=["drafter.num_layers=2", f"drafter.layer_types={json.dumps(TYPES)}", "drafter.sliding_window=64"]
        )
    )
    spec = drafter_spec(cfg)
    assert (spec.layer_type(0), spec.layer_type(1), spec.sliding_window) == (*TYPES, 64)


def test_zlab_quick_start_on_a_sliding_export_decodes_as_the_trainer(trained, tmp_path):
    """z-lab's README quick start (AutoModel + `spec_generate`, only torch and transformers in the
    process) on the sliding-window export: the target's greedy text, with exactly the verify
    steps of the trainer's own loop (so the same drafts were accepted, window and all)."""
    pytest.importorskip("transformers")
    from test_speculate import save_target_for_transformers

    from dflash_train.export import export_drafter

    cfg, replica, prompts, _ = trained
    export = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    save_target_for_transformers(replica.target, tmp_path / "target")
    ours = [speculate(replica.target, replica.drafter, p, 24) for p in prompts]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(
        json.dumps({"prompts": prompts, "max_new_tokens": 24, "runs": [{"temperature": 0.0, "stop_token_ids": None}]})
    )
    script = Path(__file__).with_name("zlab_quickstart.py")
    subprocess.run(
        [sys.executable, "-I", str(script), str(tmp_path / "target"), str(export), str(job), str(out)],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=600,
    )
    (results,) = json.loads(out.read_text())["results"]
    for got, mine in zip(results, ours):
        assert got["spec"] == got["greedy"] == mine.tokens
        assert got["steps"] == len(mine.accepted)
    assert sum(len(m.tokens) for m in ours) > 1.2 * sum(len(m.accepted) for m in ours)  # drafts were accepted
