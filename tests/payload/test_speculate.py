"""The speculative decoding loop (speculate.py) on a briefly trained tiny drafter, on the CPU:
lossless against the target's own greedy decode, and its acceptance equal, block by block, to
the teacher-forced acceptance at the anchors the loop actually used; the export through
transformers, both the trainer's API and z-lab's (`spec_generate`, issue 28)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.config import load_config
from dflash_train.data import BlockSampler, build_datasets
from dflash_train.model import block_input_ids, block_mask
from dflash_train.compiling import EAGER  # what the plan picks on the CPU: run.compile off
from dflash_train.replica import build_replica, train_step
from dflash_train.plan import resolve_run
from dflash_train.decode import greedy, make_decoder
from dflash_train.speculate import DraftDecoder, acceptance_by_position, decode_room, held_out_prompts, speculate
from dflash_train.target import hf_state_dict

PROMPTS = 20
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny drafter trained for 150 steps on its target's greedy text (the demo data)."""
    out = tmp_path_factory.mktemp("spec") / "run"
    cfg = resolve_run(load_config(preset="tiny", overrides=[f"run.output_dir={out}"])).cfg
    train, held_out = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    replica = build_replica(cfg, "cpu", cfg.run.seed, EAGER)
    for step in range(150):
        train_step(replica, sampler.batch(step))
    prompts = [[int(t) for t in ids[: cfg.data.prompt_length]] for ids, _ in (held_out + train)[:PROMPTS]]
    return cfg, replica, prompts


def teacher_forced_run(replica, sequence: list[int], feats: torch.Tensor, anchor: int) -> int:
    """Drafts the trainer's forward makes at `anchor` of the whole sequence that agree with it, leading run
    (`feats`: the target's features of the whole sequence, the same for every anchor)."""
    spec = replica.drafter.spec
    ids = torch.tensor([sequence])
    anchors = torch.tensor([[anchor]])
    embeds = replica.target.embed_tokens(block_input_ids(ids, anchors, spec.block_size, spec.mask_token_id))
    with torch.no_grad():
        hidden = replica.drafter(feats, embeds, anchors, block_mask(anchors, ids.shape[1], spec.block_size, "dense"))
        drafts = replica.target.lm_head(hidden[0, 1:]).argmax(-1).tolist()
    labels = sequence[anchor + 1 : anchor + spec.block_size]
    run = 0
    while run < len(drafts) and drafts[run] == labels[run]:
        run += 1
    return run


def test_greedy_speculation_is_lossless_and_matches_teacher_forcing(trained):
    cfg, replica, prompts = trained
    block = cfg.drafter.block_size
    results = []
    for prompt in prompts:
        spec = speculate(replica.target, replica.drafter, prompt, NEW_TOKENS)
        reference = greedy(replica.target, prompt, NEW_TOKENS + block)  # labels beyond the last block too
        assert spec.tokens == reference[:NEW_TOKENS]  # lossless: the target's own greedy text
        full = prompt + reference
        feats = replica.target.features(torch.tensor([full]), replica.drafter.spec.target_layer_ids)
        for anchor, accepted in zip(spec.anchors, spec.accepted):
            assert accepted == teacher_forced_run(replica, full, feats, anchor), (prompt, anchor)
        results.append(spec)
    taus = [r.tau for r in results]
    per_position = acceptance_by_position(results, block)
    assert all(1.0 <= t <= block for t in taus) and sum(taus) / len(taus) > 1.2  # the drafter learned something
    assert per_position == sorted(per_position, reverse=True) and len(per_position) == block - 1


def test_the_cached_drafter_drafts_what_the_training_forward_drafts(trained):
    """DraftDecoder (context keys cached, a block's B positions of context written per verify
    step, the unaccepted ones stale) against the training forward at the same anchors."""
    _, replica, prompts = trained
    spec = replica.drafter.spec
    block = spec.block_size
    sequence = prompts[0] + greedy(replica.target, prompts[0], 3 * block)
    ids = torch.tensor([sequence])
    feats = replica.target.features(ids, spec.target_layer_ids)

    def trained_forward(anchor: int) -> torch.Tensor:
        anchors = torch.tensor([[anchor]])
        embeds = replica.target.embed_tokens(block_input_ids(ids, anchors, block, spec.mask_token_id))
        with torch.no_grad():
            hidden = replica.drafter(feats[:, :anchor], embeds, anchors, block_mask(anchors, anchor, block, "dense"))
        return replica.target.lm_head(hidden[0, 1:])

    drafting = DraftDecoder(replica.drafter, replica.target, len(sequence) + block)
    anchor = len(prompts[0])
    drafting.add_context(feats[:, :anchor], 0)
    for accepted in (2, 0, 5):
        torch.testing.assert_close(
            drafting.draft(sequence[anchor], anchor), trained_forward(anchor), rtol=1e-5, atol=1e-5
        )
        drafting.add_context(feats[:, anchor : anchor + block], anchor)  # a verify step's B positions
        anchor += accepted + 1


SAMPLES = 1000  # each a whole speculate() call: the file's longest test at 2000 (~90 s on 2 idle cores)


def test_sampled_speculation_is_distributed_as_the_target(trained):
    """Temperature 1: the token decided by the first verify step has the target's own distribution
    (the marginal over the prefill's sampled token, computed exactly), within a statistical bound."""
    _, replica, prompts = trained
    target, drafter, prompt = replica.target, replica.drafter, prompts[0]
    generator = torch.Generator().manual_seed(0)
    # One verifier and drafting cache for every call, as speculative_eval reuses them across
    # prompts: each call's prefill starts them over (a fresh pair per call cost ~40% of its time).
    room = decode_room(len(prompt), 2, drafter.spec.block_size)
    verifier = make_decoder(target, 1, room, drafter.spec.target_layer_ids)
    drafting = DraftDecoder(drafter, target, room)
    samples, accepted = [], []
    for _ in range(SAMPLES):
        out = speculate(
            target, drafter, prompt, 2, temperature=1.0, generator=generator, verifier=verifier, drafting=drafting
        )
        samples.append(out.tokens[1])
        accepted.append(out.accepted[0])
    with torch.no_grad():
        first = torch.softmax(target.logits(torch.tensor([prompt]))[0, -1], -1)  # p(t1 | prompt)
        support = torch.nonzero(first > 1e-7).flatten()
        batch = torch.cat([torch.tensor([prompt]).expand(len(support), -1), support[:, None]], dim=1)
        second = torch.softmax(target.logits(batch)[:, -1], -1)  # p(t2 | prompt, t1)
        exact = (first[support, None] * second).sum(0)  # p(t2 | prompt)
    empirical = torch.bincount(torch.tensor(samples), minlength=exact.numel()).float() / len(samples)
    # The target's 20 likeliest tokens and the rest as one bin: with 2000 samples an exact sampler
    # was within ~0.02 total variation of this (measured: 0.014 for plain ancestral sampling); 1000
    # samples widen the sampling noise by sqrt(2), to ~0.02-0.03, still well inside the bound.
    top = torch.topk(exact, 20).indices

    def binned(dist: torch.Tensor) -> torch.Tensor:
        return torch.cat([dist[top], (1 - dist[top].sum()).view(1)])

    tv = 0.5 * float((binned(empirical) - binned(exact)).abs().sum())
    assert tv < 0.06, tv
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # both paths ran: drafts kept, drafts replaced


def test_the_export_loads_with_transformers_automodel_and_drafts_the_same(trained, tmp_path):
    """Issue 15: `AutoModel.from_pretrained(export, trust_remote_code=True)` gives the trainer's
    drafter (same hidden states through `block_forward`, the trainer's forward), and the
    speculative loop driven by it decodes the same tokens."""
    transformers = pytest.importorskip("transformers")
    from dflash_train.export import export_drafter

    cfg, replica, prompts = trained
    out = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    loaded = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    assert type(loaded).__name__ == "DFlashDraftModel"
    spec = replica.drafter.spec
    ids = torch.tensor([prompts[0] + prompts[1]])
    anchors = torch.tensor([[3, 7]])
    feats = replica.target.features(ids, spec.target_layer_ids)
    embeds = replica.target.embed_tokens(block_input_ids(ids, anchors, spec.block_size, spec.mask_token_id))
    mask = block_mask(anchors, ids.shape[1], spec.block_size, "dense")
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.block_forward(feats, embeds, anchors, mask), replica.drafter(feats, embeds, anchors, mask)
        )
    for prompt in prompts[:4]:
        ours = speculate(replica.target, replica.drafter, prompt, 24)
        theirs = speculate(replica.target, loaded, prompt, 24)
        assert theirs.tokens == ours.tokens and theirs.accepted == ours.accepted


def test_the_exports_zlab_forward_with_a_cache_drafts_what_the_training_forward_drafts(trained, tmp_path):
    """Issue 28: z-lab's forward (context features in pieces, appended to a transformers cache,
    the block's own entries cropped off after each call) gives the hidden states the trainer's
    forward gives for a block at the same anchor over the whole context."""
    transformers = pytest.importorskip("transformers")
    from dflash_train.export import export_drafter

    cfg, replica, prompts = trained
    out = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    loaded = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    assert (loaded.block_size, loaded.mask_token_id) == (cfg.drafter.block_size, cfg.drafter.mask_token_id)
    assert loaded.target_layer_ids == list(replica.drafter.spec.target_layer_ids)
    spec, block = replica.drafter.spec, cfg.drafter.block_size
    ids = torch.tensor([prompts[0] + prompts[1]])
    feats = replica.target.features(ids, spec.target_layer_ids)
    cache = transformers.DynamicCache()
    done = 0
    for anchor in (5, 6, 11, ids.shape[1] - 1):  # context arrives in pieces of 5, 1, 5, and the rest
        anchors = torch.tensor([[anchor]])
        block_ids = block_input_ids(ids, anchors, block, spec.mask_token_id)
        embeds = replica.target.embed_tokens(block_ids)
        with torch.no_grad():
            ours = replica.drafter(feats[:, :anchor], embeds, anchors, block_mask(anchors, anchor, block, "dense"))
            theirs = loaded(
                position_ids=torch.arange(done, anchor + block)[None],
                noise_embedding=embeds,
                target_hidden=feats[:, done:anchor],
                past_key_values=cache,
                use_cache=True,
            )
        cache.crop(-block)  # the block's own keys and values: the cache keeps the context only
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        done = anchor


def save_target_for_transformers(target, path):
    """Our Qwen3 target as a transformers checkpoint: config.json + one model.safetensors."""
    cfg = target.cfg
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "num_hidden_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "vocab_size": cfg.vocab_size,
                "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_norm_eps,
                "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": cfg.tie_word_embeddings,
                "torch_dtype": "float32",
            }
        )
    )
    # Clones: the split projections are views of one fused weight, which safetensors refuses to save.
    tied = cfg.tie_word_embeddings
    state = {k: v.clone() for k, v in hf_state_dict(target).items() if not (tied and k.startswith("lm_head"))}
    save_file(state, str(path / "model.safetensors"))


def test_zlab_quick_start_on_the_export_is_lossless_and_stops(trained, tmp_path):
    """Issue 28: z-lab's README quick start (AutoModel + `spec_generate` with a transformers
    target) on an export, in a process that imports only torch and transformers: the target's own
    greedy text, the same verify steps as the trainer's loop (`dflashctl eval`), a stop token
    ends the output (inclusive), and the sampled path kept to one token by top_k or top_p
    decodes the same."""
    pytest.importorskip("transformers")
    from dflash_train.export import export_drafter

    cfg, replica, prompts = trained
    export = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    save_target_for_transformers(replica.target, tmp_path / "target")
    new_tokens, chosen = 24, prompts[:4]
    ours = [speculate(replica.target, replica.drafter, p, new_tokens) for p in chosen]
    first = ours[0].tokens
    stop = next((t for t in first if first.index(t) > 0), first[0])  # a token first emitted after the prefill's
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    script = Path(__file__).with_name("zlab_quickstart.py")

    job, out = tmp_path / "job.json", tmp_path / "out.json"
    runs = [
        {"temperature": 0.0, "stop_token_ids": None},
        {"temperature": 0.0, "stop_token_ids": [stop]},
        # Sampling kept to the one likeliest token: the sampled path must give the greedy text.
        {"temperature": 1.0, "top_k": 1, "stop_token_ids": None},
        {"temperature": 0.7, "top_p": 1e-6, "stop_token_ids": None},
    ]
    job.write_text(json.dumps({"prompts": chosen, "max_new_tokens": new_tokens, "runs": runs}))
    subprocess.run(
        [sys.executable, "-I", str(script), str(tmp_path / "target"), str(export), str(job), str(out)],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=600,
    )
    done = json.loads(out.read_text())
    assert done["attributes"] == {
        "block_size": cfg.drafter.block_size,
        "mask_token_id": cfg.drafter.mask_token_id,
        "target_layer_ids": list(replica.drafter.spec.target_layer_ids),
    }
    plain, stopped, top_k, top_p = done["results"]
    for got, mine in zip(plain, ours):
        assert got["prompt_kept"] and got["spec"] == got["greedy"] == mine.tokens  # lossless, as eval decodes
        assert got["steps"] == len(mine.accepted)  # the drafts accepted are the trainer's loop's
    assert sum(len(m.tokens) for m in ours) > 1.2 * sum(len(m.accepted) for m in ours)  # drafts were accepted
    cut = first.index(stop) + 1
    assert stopped[0]["spec"] == stopped[0]["greedy"] == first[:cut] and cut < new_tokens
    for got, reference in zip(top_k + top_p, plain + plain):
        assert (got["spec"], got["steps"]) == (reference["spec"], reference["steps"])


def test_zlabs_own_package_decodes_the_export_as_eval_does(trained, tmp_path):
    """Step 4 with z-lab's own code, not the export's modeling file: their PyPI package's
    `DFlashDraftModel.from_pretrained` takes the export as it is, and their `dflash_generate` with a
    transformers target emits the target's greedy text in the verify steps of the trainer's loop."""
    zlab = pytest.importorskip("dflash.model", reason="z-lab's package: pip install --no-deps dflash==0.1.0")
    transformers = pytest.importorskip("transformers")
    from dflash_train.export import export_drafter

    cfg, replica, prompts = trained
    export = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    save_target_for_transformers(replica.target, tmp_path / "target")
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    draft = zlab.DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    assert (draft.block_size, draft.mask_token_id) == (cfg.drafter.block_size, cfg.drafter.mask_token_id)
    assert list(draft.target_layer_ids) == list(replica.drafter.spec.target_layer_ids)
    calls = []
    target.register_forward_hook(lambda module, args, output: calls.append(1))
    new_tokens, accepted = 24, 0
    for prompt in prompts[:4]:
        mine = speculate(replica.target, replica.drafter, prompt, new_tokens)
        calls.clear()
        out = zlab.dflash_generate(draft, target, torch.tensor([prompt]), new_tokens, None)
        assert out[0, : len(prompt)].tolist() == prompt
        assert out[0, len(prompt) :].tolist() == mine.tokens  # lossless: the target's greedy text (tested above)
        assert len(calls) - 1 == len(mine.accepted)  # their verify steps (target calls after the prefill) are ours
        accepted += len(mine.tokens) - len(mine.accepted)
    assert accepted > 0  # drafts were accepted (17 of 96 tokens here): the loaded weights draft, not only the target


def test_the_exports_sampling_rule_keeps_the_targets_distribution(trained, tmp_path):
    """Issue 28: spec_generate's sampled path, its helpers taken from the loaded export's module:
    a draft drawn from q and judged against p emits a first token distributed as p (the
    speculative-sampling rule), and top_k / top_p keep the likeliest tokens, renormalised."""
    transformers = pytest.importorskip("transformers")
    from dflash_train.export import export_drafter

    cfg, replica, _ = trained
    out = export_drafter(replica.drafter, cfg.target, tmp_path / "export", torch.float32)
    shipped = sys.modules[type(transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True)).__module__]
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(shipped._probs(logits, 1.0, 1.0, 0), probs)
    top2 = torch.tensor([[probs[0, 0], probs[0, 1], 0, 0]])
    torch.testing.assert_close(shipped._probs(logits, 1.0, 1.0, 2), top2 / top2.sum())
    torch.testing.assert_close(shipped._probs(logits, 1.0, float(probs[0, 0]) + 1e-3, 0), top2 / top2.sum())
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])  # the drafter's row
    p = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])  # the target's rows
    torch.manual_seed(0)
    first = []
    for _ in range(20000):
        draft = torch.multinomial(q[0], 1)
        k, following = shipped._accept(draft, q, p, 1.0)
        first.append(int(draft) if k == 1 else following)
    empirical = torch.bincount(torch.tensor(first), minlength=4).float() / len(first)
    # Total variation from p: 0.002 (seed 0); with the rejected draft replaced by a draw from p
    # instead of max(0, p - q), 0.15; q itself is 0.5 away.
    assert 0.5 * float((empirical - p[0]).abs().sum()) < 0.02


def test_held_out_prompts_takes_at_most_count_and_none_for_zero():
    """run.spec_prompts=0 turns the in-training loop off: no prompts (it once meant all of them)."""
    seqs = [(torch.arange(10), torch.tensor([False] * 4 + [True] * 6)) for _ in range(3)]
    assert held_out_prompts(seqs, 0, 5) == []
    assert held_out_prompts(seqs, 2, 5) == [list(range(4))] * 2
