"""The quality check of issue 26 (CPU, deterministic, no timing): a tiny Qwen3 target trained on real
Python source by bench/build_target.py (the bench's own builder), a short drafter run through the
trainer's own code on the target's greedy continuations, then real speculative decoding on prompts
from packages the target never saw: the drafter must have learned (tau well above 1) and must
beat the free baseline, n-gram prompt lookup, by a stated margin. A change that breaks learning
fails here.

What the tiny target is: 0.2M parameters trained for 120 steps (loss ~4.5 nats/token), so its
greedy text is mostly runs of blank lines and short repeated fragments (`self.assertEqual(self):`);
real in origin, learnable, but no quality figure for users (that is bench/quality.py on a GPU,
docs/quality.md).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.decode import generate
from dflash_train.data import encode_prompt_rows, read_prompt_rows
from dflash_train.evaluate import evaluate_run
from dflash_train.regen_rows import token_row
from dflash_train.plan import resolve_run
from dflash_train.target import load_hf_target, read_hf_config
from dflash_train.train import run_training

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
build_target = pytest.importorskip("build_target")  # the one builder, shared with bench/quality.py
pytest.importorskip("transformers")

BLOCK = 8  # drafter block: 7 drafted tokens per verify step, for the drafter and for prompt lookup alike
NEW_TOKENS = 48  # per prompt, in the training rows and in the evaluation
DRAFTER_STEPS = 900
DRAFTER_LR = 5e-3
# Measured on the 2-core CPU box (torch 2.13, Python 3.11's stdlib), 2026-12-02, against the eval's
# own prompt lookup (3-gram, 7 tokens, tau 4.35 pooled on these prompts): drafter tau 4.18 after
# 300 steps (0.96x: lost), 5.15 after 600 (1.19x), 5.49 after 900 (1.26x). docs/quality.md.
MIN_TAU = 2.5
MIN_RATIO_OVER_LOOKUP = 1.15


def tiny_options(out: Path, seed: int = 0) -> "build_target.BuildOptions":
    """The CI target: fixed steps and seeds, one torch thread, a 1 MB slice of the stdlib."""
    return build_target.BuildOptions(
        out=out,
        size="tiny",
        steps=120,
        seq_len=128,
        batch_size=16,
        lr=3e-3,
        warmup=0.03,
        seed=seed,
        device="cpu",
        corpus="stdlib",
        max_corpus_mb=1.0,
        tokenizer_mb=1.0,
        train_prompts=192,
        eval_prompts=16,
        prompt_chars=160,
        cpu_threads=1,
    )


@pytest.fixture(scope="session")
def tiny_real_target(tmp_path_factory) -> Path:
    """The tiny target directory, built once per session."""
    out = tmp_path_factory.mktemp("real-target") / "target"
    build_target.build(tiny_options(out), log=lambda line: None)
    return out


def greedy_rows(target_dir: Path, prompts_file: Path, out: Path) -> int:
    """The target's greedy continuations of the prompt rows as the trainer's token rows (what
    `data regen` writes), with the MASK token never generated; the longest row's length."""
    cfg = read_hf_config(target_dir)
    target = load_hf_target(target_dir, [], "cpu", torch.float32, whole=True)
    prompts = encode_prompt_rows(read_prompt_rows(str(prompts_file)), str(target_dir), cfg.vocab_size)
    mask = json.loads((target_dir / "build.json").read_text())["special_ids"][build_target.MASK]
    new = generate(target, prompts, NEW_TOKENS, banned_ids=(mask,))
    rows = [token_row(i, p, n, "length") for i, (p, n) in enumerate(zip(prompts, new))]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return max(len(row["input_ids"]) for row in rows)


def drafter_against_lookup(target_dir: Path, work: Path, seed: int = 0) -> dict:
    """Train a drafter briefly on the target's greedy text, evaluate it as `dflashctl eval` does
    on the held-out prompts, and prompt lookup on the same greedy references."""
    rows = work / "rows.jsonl"
    longest = greedy_rows(target_dir, target_dir / "train-prompts.jsonl", rows)
    run_dir = work / "run"
    cfg = load_config(
        overrides=[
            f"target.path={target_dir}",
            "data.source=jsonl",
            f"data.train_path={rows}",
            f"data.max_length={longest}",
            f"drafter.block_size={BLOCK}",
            f"run.steps={DRAFTER_STEPS}",
            f"run.eval_every={DRAFTER_STEPS}",
            f"run.checkpoint_every={DRAFTER_STEPS}",
            f"run.log_every={DRAFTER_STEPS}",
            "run.spec_prompts=0",
            f"optim.lr={DRAFTER_LR}",
            "drafter.num_layers=1",
            "data.anchors_per_seq=8",
            "data.batch_size=8",
            f"run.seed={seed}",
            f"run.output_dir={run_dir}",
        ]
    )
    assert run_training(cfg, log=lambda line: None) == 0
    held_out = read_prompt_rows(str(target_dir / "heldout-prompts.jsonl"))
    # As `dflashctl eval` reports it: the drafter and, on the same decode path, prompt lookup.
    report = evaluate_run(run_dir, held_out, NEW_TOKENS, len(held_out), "cpu")
    return {
        "tau": report["tau"],
        "identical": report["identical"],
        "lookup_tau": report["baseline"]["tau"],
        "lookup_identical": report["baseline"]["identical"],
        "prompts": report["prompts"],
    }


def test_the_built_target_loads_in_the_trainer_as_in_transformers(tiny_real_target):
    """The directory is a user's Qwen3 checkpoint to both: same logits, `<|MASK|>` found, chat rows render."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.data import tokenize_chat

    cfg = resolve_run(load_config(overrides=[f"target.path={tiny_real_target}", "run.output_dir=unused"])).cfg
    ids = json.loads((tiny_real_target / "build.json").read_text())["special_ids"]
    assert cfg.drafter.mask_token_id == ids[build_target.MASK]
    assert cfg.target.num_layers == 2 and not cfg.target.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_real_target, local_files_only=True)
    text = (tiny_real_target / "heldout-prompts.jsonl").read_text().splitlines()[0]
    prompt = tok(json.loads(text)["prompt"])["input_ids"]
    ours = load_hf_target(tiny_real_target, [], "cpu", torch.float32, whole=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_real_target, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits
    torch.testing.assert_close(ours.logits(torch.tensor([prompt])), expected, atol=1e-4, rtol=1e-4)
    ids_, mask = tokenize_chat(
        [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "return 1"}], tok
    )
    assert tok.decode(ids_[mask]) == "return 1<|im_end|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # what eval and regen continue


@pytest.mark.slow
def test_a_short_drafter_run_beats_prompt_lookup_on_held_out_prompts(tiny_real_target, tmp_path):
    figures = drafter_against_lookup(tiny_real_target, tmp_path)
    assert figures["identical"] and figures["prompts"] == 16
    print(f"quality check: {figures}")
    assert figures["tau"] >= MIN_TAU, figures
    assert figures["tau"] >= MIN_RATIO_OVER_LOOKUP * figures["lookup_tau"], figures
