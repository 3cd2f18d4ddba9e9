"""Targets through transformers (target_hf.py), one tiny random checkpoint per architecture built
here with transformers itself (no download): features and logits against the model's own
forward, batched greedy decode against its own `generate`, lossless speculative decoding, a
short training run whose loss falls; the backend choice and the errors for what cannot be a target."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dflash_train.__main__ import main  # noqa: E402
from dflash_train.config import Config, ConfigError, TargetConfig, load_config  # noqa: E402
from dflash_train.data import BlockSampler, build_datasets  # noqa: E402
from dflash_train.decode import generate, greedy, make_decoder  # noqa: E402
from dflash_train.model import DFlashDrafter, rope_inv_freq  # noqa: E402
from dflash_train.replica import build_replica, forward_loss, train_step  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402
from dflash_train.resolve import drafter_spec  # noqa: E402
from dflash_train.speculate import speculate  # noqa: E402
from dflash_train.target import load_hf_target  # noqa: E402
from dflash_train.target_config import choose_backend, read_target_config  # noqa: E402
from dflash_train.target_hf import HFDecoder, HFTarget, build_hf_target  # noqa: E402


def resolved(cfg: Config, notes: list[str] | None = None) -> Config:
    """The config as the run plan fills it on a machine without CUDA (its decisions' lines into `notes`)."""
    plan = resolve_run(cfg, cuda_count=0)
    if notes is not None:
        notes.extend(plan.notes)
    return plan.cfg


VOCAB = 160
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# The architectures covered (docs/trainer.md): each as transformers' own config class builds it.
ARCHS = {
    "llama": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
    "mistral": dict(model_type="mistral", sliding_window=8, head_dim=12),  # a window the tests pass
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    ),
    "phi3": dict(model_type="phi3", pad_token_id=0),  # fused qkv and gate_up projections
}


def save_tiny(path, arch: str, seed: int = 0, vocab: int = VOCAB) -> transformers.PreTrainedModel:
    """A random tiny checkpoint of `arch` (weights wide enough that greedy text varies)."""
    fields = dict(COMMON, **ARCHS[arch], vocab_size=vocab)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(arch, checkpoint dir, the model transformers built) per architecture."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(path, request.param)


def test_features_and_logits_are_the_models_own(checkpoint):
    """Features = hidden_states[i + 1] of the model's own forward (the early-exit build and the
    whole one), logits = its logits; only the layers up to the last feature layer are built."""
    arch, path, model = checkpoint
    t = read_target_config(path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1)  # layers 0 and 2 of 4
    early = build_hf_target(t, [0, 2])
    assert len(early.layers) == 3 and not any(p.requires_grad for p in early.parameters())
    torch.testing.assert_close(early.features(ids, [0, 2]), expected, rtol=1e-5, atol=1e-5)
    whole = build_hf_target(t, [0, 2], whole=True)
    torch.testing.assert_close(whole.features(ids, [0, 2]), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.logits(ids), ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.lm_head.weight, model.lm_head.weight)


def test_batched_greedy_decode_is_the_models_own_generate(checkpoint):
    """decode.generate over left-padded rows (the regen and eval path) = transformers' generate."""
    arch, path, model = checkpoint
    target = build_hf_target(read_target_config(path), [], whole=True)
    prompts = [[5, 9, 2, 77, 31, 8], [40, 3, 3]]
    ours = generate(target, prompts, 12)
    ids = torch.tensor([prompts[0], [0] * 3 + prompts[1]])
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    theirs = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )[:, 6:]
    assert ours == theirs.tolist()
    assert len(set(ours[0])) > 2  # the text varies: the comparison can fail


def test_a_prefill_asks_the_model_for_the_last_positions_logits_only(checkpoint):
    """As the native decoder: the model's head runs on one position per row of the prompts."""
    arch, path, model = checkpoint
    target = build_hf_target(read_target_config(path), [], whole=True)
    prompts = [[5, 9, 2, 77, 31, 8], [40, 3, 3, 12, 6, 1]]
    heads = []
    hook = target.lm_head.register_forward_hook(lambda _m, args, _out: heads.append(args[0].shape[1]))
    try:
        last, _ = HFDecoder(target, 2, 32).prefill(prompts)
    finally:
        hook.remove()
    assert heads == [1]
    with torch.no_grad():
        torch.testing.assert_close(last, model(torch.tensor(prompts)).logits[:, -1], rtol=1e-5, atol=1e-5)


def test_greedy_speculative_decoding_is_lossless(checkpoint):
    """The speculative loop with this target (verify steps of B tokens through the model's cache,
    rejected drafts cropped off it) emits exactly the target's greedy text."""
    arch, path, _ = checkpoint
    cfg = resolved(
        load_config(
            overrides=[f"target.path={path}", "drafter.mask_token_id=1", "drafter.num_layers=1", "drafter.block_size=4"]
        )
    )
    assert cfg.target.backend == ("native" if arch == "qwen3" else "transformers")
    target = build_hf_target(cfg.target, [], whole=True)
    drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.init_weights(0.02, 0)
    for prompt in ([5, 9, 2, 77, 31, 8], [40, 3]):
        out = speculate(target, drafter, prompt, 20)
        assert out.tokens == greedy(target, prompt, 20)
        assert len(out.accepted) > 1


def greedy_rows(target: HFTarget, count: int, length: int) -> list[dict]:
    """Training rows: the target's own greedy continuations of random 4-token prompts."""
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(2, VOCAB, (count, 4), generator=gen).tolist()
    news = generate(target, prompts, length - 4)
    return [{"input_ids": p + n, "loss_mask": [0] * 4 + [1] * len(n)} for p, n in zip(prompts, news)]


def test_a_short_training_run_lowers_the_loss(checkpoint, tmp_path):
    """build_replica with the checkpoint as target (the transformers backend unless native applies):
    the loss on a fixed batch falls over a few steps."""
    arch, path, _ = checkpoint
    rows = greedy_rows(build_hf_target(read_target_config(path), [], whole=True), 16, 40)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = resolve_run(
        load_config(
            preset="tiny",
            overrides=[
                f"target.path={path}",
                "target.backend=transformers",
                "drafter.mask_token_id=1",
                "data.source=jsonl",
                f"data.train_path={data}",
                "data.max_length=40",
                "data.anchors_per_seq=6",
                "data.batch_size=4",
                "drafter.block_size=4",
                "run.spec_prompts=0",
                f"run.output_dir={tmp_path / 'run'}",
            ],
        ),
        cuda_count=0,
    )
    cfg = plan.cfg
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    replica = build_replica(cfg, "cpu", cfg.run.seed, plan.policy)
    assert isinstance(replica.target, HFTarget) and len(replica.target.layers) == max(cfg.drafter.target_layer_ids) + 1
    batch = sampler.batch(0)
    before = forward_loss(replica, batch).loss.item()
    for step in range(40):
        train_step(replica, sampler.batch(step))
    assert forward_loss(replica, batch).loss.item() < 0.8 * before


def test_auto_backend_keeps_the_native_qwen3_and_says_why(tmp_path):
    """A plain Qwen3 checkpoint runs on the hand-written path (its features equal the transformers
    path's); a Llama one through transformers; the reason is among the run's notes."""
    model = save_tiny(tmp_path / "qwen3", "qwen3")
    notes: list[str] = []
    cfg = resolved(load_config(overrides=[f"target.path={tmp_path / 'qwen3'}", "drafter.mask_token_id=1"]), notes)
    assert cfg.target.backend == "native"
    assert any(n.startswith("target backend: native (auto: a dense Qwen3") for n in notes)
    ids = torch.randint(0, VOCAB, (1, 9))
    native = load_hf_target(tmp_path / "qwen3", [1, 2], dtype=torch.float32)
    generic = build_hf_target(cfg.target, [1, 2])
    torch.testing.assert_close(native.features(ids, [1, 2]), generic.features(ids, [1, 2]), rtol=1e-5, atol=1e-5)
    save_tiny(tmp_path / "llama", "llama")
    notes.clear()
    plan = resolve_run(
        load_config(overrides=[f"target.path={tmp_path / 'llama'}", "drafter.mask_token_id=1"]), cuda_count=0
    )
    assert plan.cfg.target.backend == plan.to_json()["target_backend"] == "transformers"
    assert "target backend: transformers (auto: model_type llama is not qwen3)" in plan.notes
    with pytest.raises(ConfigError, match="target.backend native cannot run this target: model_type llama"):
        resolved(
            load_config(
                overrides=[f"target.path={tmp_path / 'llama'}", "target.backend=native", "drafter.mask_token_id=1"]
            )
        )
    del model


@pytest.mark.parametrize(
    "backend,model_type,expected",
    [
        ("auto", "qwen3", "native"),
        ("auto", "llama", "transformers"),
        ("transformers", "qwen3", "transformers"),
    ],
)
def test_choose_backend(backend, model_type, expected):
    assert choose_backend(TargetConfig(backend=backend, model_type=model_type))[0] == expected


def test_the_drafter_takes_the_targets_shape_rope_scaling_and_eps(tmp_path):
    """The drafter's width, heads, head_dim, norm eps and rope (Llama 3's scaled frequencies,
    as transformers computes them) come from the target's config.json."""
    model = save_tiny(tmp_path / "llama", "llama")
    cfg = resolved(load_config(overrides=[f"target.path={tmp_path / 'llama'}", "drafter.mask_token_id=1"]))
    shape = drafter_spec(cfg).shape
    c = model.config
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps) == (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.rms_norm_eps,
    )
    assert dict(shape.rope_scaling)["rope_type"] == "llama3"
    expected, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
    got = rope_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, rope_inv_freq(shape.head_dim, shape.rope_theta))  # the scaling bites


def test_an_encoder_only_model_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    assert main(["--preflight", "--set", f"target.path={tmp_path}"]) == 2
    message = json.loads(capsys.readouterr().out)["message"]
    assert (
        message
        == f"target.path: {tmp_path}: BertForMaskedLM is not a causal LM (encoder-only models cannot be targets)"
    )


def test_a_vocabulary_without_a_spare_row_needs_a_mask_id(tmp_path, capsys):
    """Every embedding row is a token (Llama 3's case) and no drafter.mask_token_id: exit 2."""
    save_tiny(tmp_path, "llama")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    assert main(["--preflight", "--set", f"target.path={tmp_path}"]) == 2
    assert "no spare embedding row for the MASK token: set drafter.mask_token_id" in capsys.readouterr().out
    assert main(["--preflight", "--set", f"target.path={tmp_path}", "--set", "drafter.mask_token_id=3"]) == 0


@pytest.mark.parametrize("preset,model_type,active", [("llama3-8b", "llama", None), ("qwen3-30b-a3b", "qwen3_moe", 8)])
def test_the_large_presets_resolve_to_the_transformers_backend(preset, model_type, active):
    """The GPU presets (real shapes, random weights): resolved here, built on the GPU."""
    notes: list[str] = []
    cfg = resolved(load_config(preset=preset), notes)
    assert cfg.target.backend == "transformers" and cfg.target.model_type == model_type
    assert (cfg.target.num_experts_per_tok or None) == active
    assert drafter_spec(cfg).shape.rope_scaling == (
        () if preset != "llama3-8b" else tuple(sorted(cfg.target.rope_scaling.items()))
    )


def test_a_random_target_of_a_presets_kind_builds_with_its_shape():
    """What the presets build on the GPU, at a tiny width: a random MoE target, deterministic per seed."""
    t = TargetConfig(
        model_type="qwen3_moe",
        num_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        tie_word_embeddings=False,
    )
    a, b = build_hf_target(t, [1], whole=True), build_hf_target(t, [1], whole=True)
    ids = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(a.logits(ids), b.logits(ids), rtol=0, atol=0)
    assert type(a.model).__name__ == "Qwen3MoeForCausalLM"
    decoder = make_decoder(a, 1, 32, (1,))
    assert isinstance(decoder, HFDecoder)


def test_regen_through_transformers_is_the_models_own_greedy_generate(tmp_path):
    """`python -m dflash_train.regen` on a Llama checkpoint (batched, left-padded, stopping at the
    checkpoint's EOS): each row is the model's own greedy `generate` of its prompt."""
    from dflash_train import regen
    from test_data import save_tokenizer

    model = save_tiny(tmp_path / "llama", "llama", vocab=320)
    tok = save_tokenizer(tmp_path / "llama")  # regen reads its end-of-turn token (as a chat target has one)
    eos = sorted({model.generation_config.eos_token_id, tok.eos_token_id})
    prompts = [[5, 9, 2, 77, 31, 8], [40, 3, 3], [7, 100, 54, 12]]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    assert (
        regen.main(
            [
                "--prompts",
                str(src),
                "--out",
                str(out),
                "--max-new-tokens",
                "10",
                "--batch-size",
                "2",
                "--gpus",
                "cpu",
                "--set",
                f"target.path={tmp_path / 'llama'}",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, prompt in zip(rows, prompts):
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos)
        assert row["input_ids"] == theirs[0].tolist()


def test_train_and_eval_through_transformers_are_lossless(tmp_path, capsys):
    """A whole run (`python -m dflash_train`, in-training tau included) on a Qwen3-MoE checkpoint,
    then `python -m dflash_train.evaluate`: greedy speculative decoding equals the target's own."""
    from dflash_train import evaluate

    save_tiny(tmp_path / "moe", "qwen3_moe")
    rows = greedy_rows(build_hf_target(read_target_config(tmp_path / "moe"), [], whole=True), 12, 40)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    sets = [
        f"target.path={tmp_path / 'moe'}",
        "drafter.mask_token_id=1",
        "data.source=jsonl",
        f"data.train_path={data}",
        "data.max_length=40",
        "data.anchors_per_seq=4",
        "data.batch_size=4",
        "drafter.block_size=4",
        "run.steps=6",
        "run.eval_every=6",
        "run.spec_prompts=2",
        "run.spec_new_tokens=8",
        f"run.output_dir={run}",
        "run.device=cpu",
    ]
    assert main(["--preset", "tiny"] + [a for s in sets for a in ("--set", s)]) == 0
    assert "target backend: transformers (auto: model_type qwen3_moe is not qwen3)" in capsys.readouterr().out
    assert evaluate.main([str(run), "--count", "2", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    report = json.loads((run / "eval.json").read_text())
    assert report["identical"] is True and report["prompts"] >= 1


def test_an_export_with_the_targets_rope_scaling_loads_with_the_same_states(tmp_path):
    """A drafter for a Llama 3 target: config.json carries the llama3 rope scaling, and the
    export's transformers model (loaded strictly) computes with it, as the trainer's drafter does."""
    from dflash_train.export import export_drafter, load_exported
    from dflash_train.model import block_input_ids, block_mask

    save_tiny(tmp_path / "llama", "llama")
    cfg = resolved(
        load_config(overrides=[f"target.path={tmp_path / 'llama'}", "drafter.mask_token_id=1", "drafter.block_size=4"])
    )
    target = build_hf_target(cfg.target, cfg.drafter.target_layer_ids)
    drafter = DFlashDrafter(drafter_spec(cfg))
    drafter.init_weights(0.05, 0)
    out = export_drafter(drafter, cfg.target, tmp_path / "export", torch.float32)
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert load_exported(out)[0].spec == drafter.spec
    loaded, info = transformers.AutoModel.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert repr(loaded.spec) == repr(drafter.spec)
    ids = torch.randint(2, VOCAB, (1, 90), generator=torch.Generator().manual_seed(3))  # past the original 64 positions
    anchors = torch.tensor([[10, 80]])
    feats = target.features(ids, drafter.spec.target_layer_ids)
    embeds = target.embed_tokens(block_input_ids(ids, anchors, 4, 1))
    mask = block_mask(anchors, ids.shape[1], 4, "dense")
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.block_forward(feats, embeds, anchors, mask), drafter(feats, embeds, anchors, mask)
        )
