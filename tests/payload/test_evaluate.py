"""`python -m dflash_train.evaluate` with chat and text prompts (issue 15): they are encoded by the
run's tokenizer, a chat with its template's generation prompt after the last user turn."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from types import SimpleNamespace

import pytest
from test_data import CHATS, save_tokenizer

from dflash_train.config import ConfigError, load_config
from dflash_train.data import DataError, read_prompt_rows
from dflash_train.evaluate import main as evaluate
from dflash_train.evaluate import run_bytecode_dir, run_prompts_source
from dflash_train.plan import resolve_run
from dflash_train.train import load_data, run_training, spec_prompts


def test_chat_and_text_prompts_go_through_the_runs_tokenizer(tmp_path, capsys):
    tok = save_tokenizer(tmp_path / "tok")
    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"run.output_dir={out}",
            "run.steps=10",
            "run.eval_every=10",
            "run.checkpoint_every=10",
            f"data.tokenizer_path={tmp_path / 'tok'}",
            "drafter.mask_token_id=511",
        ]
    )
    assert run_training(cfg, log=lambda line: None) == 0
    chat = CHATS[0][:4]  # up to "And the dog?": answered after that user turn
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": chat + [{"role": "assistant", "content": "ignored"}]})
        + "\n"
        + json.dumps({"prompt": "Say hello."})
        + "\n"
    )
    assert evaluate([str(out), "--prompts", str(prompts), "--max-new-tokens", "6"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = [len(tok(rendered, add_special_tokens=False)["input_ids"]), len(tok("Say hello.")["input_ids"])]
    assert [r["prompt_tokens"] for r in report["per_prompt"]] == expected and report["identical"]
    prompts.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    assert evaluate([str(out), "--prompts", str(prompts)]) == 2
    assert capsys.readouterr().err.strip().endswith("eval error: prompts line 1: messages has no user turn to answer")


def test_the_report_carries_the_prompt_lookup_baseline_unless_turned_off(tmp_path, capsys):
    """Issue 26: prompt lookup decoded beside the drafter on the same path, lossless, both tau
    figures and the drafter's ratios in eval.json; --no-baseline leaves it out. Issue 29: eval
    applies the run's run.cpu_threads, as its trainer did."""
    import torch

    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"run.output_dir={out}",
            "run.steps=10",
            "run.eval_every=10",
            "run.checkpoint_every=10",
            "run.cpu_threads=1",
        ]
    )
    assert run_training(cfg, log=lambda line: None) == 0
    torch.set_num_threads(2)  # as a shell's default would leave it
    try:
        assert evaluate([str(out), "--count", "3", "--max-new-tokens", "24"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert json.loads((out / "eval.json").read_text()) == report
    assert report["prompts_source"] == {
        "from": "the held-out split of the demo data (seed 0)",
        "file": None,
        "rows": None,
        "sha256": None,
    }
    free = report["baseline"]
    assert free["method"] == "prompt lookup" and free["num_tokens"] == report["block_size"] - 1
    assert free["identical"] and all(r["identical"] for r in free["per_prompt"]) and len(free["per_prompt"]) == 3
    for figures in (report, free):
        per_prompt = [r["tau"] for r in figures["per_prompt"]]
        assert figures["tau_prompt_mean"] == sum(per_prompt) / 3 and 1.0 <= figures["tau"] <= report["block_size"]
    assert report["drafter_vs_baseline"] == {
        key: report[key] / free[key] for key in ("tau", "tau_prompt_mean", "speedup")
    }
    assert evaluate([str(out), "--count", "2", "--max-new-tokens", "8", "--no-baseline"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["baseline"] is None and "drafter_vs_baseline" not in report and report["identical"]


def test_a_demo_runs_held_out_prompts_are_drawn_without_its_data():
    """eval's default prompts (train.spec_prompts): for the demo source, the held-out prompts
    load_data gives, without generating the sequences they start."""
    overrides = ["run.spec_prompts=5", "data.num_train=24", "data.num_eval=8", "data.prompt_length=6"]
    cfg = resolve_run(load_config(overrides=overrides), cuda_count=0).cfg
    prompts = spec_prompts(cfg)
    assert prompts == load_data(cfg)[2] and len(prompts) == 5 and {len(p) for p in prompts} == {6}


def test_the_in_training_decode_takes_its_prompts_from_a_file_when_given(tmp_path):
    """data.spec_prompts_path (a pushed `data:NAME` too): the trainer's speculative evaluation decodes
    the first run.spec_prompts prompts of that file, as `eval --prompts` does, not the held-out split."""
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [9, 1]}, {"input_ids": [4] * 5}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "run.spec_prompts=2",
        "data.source=random",
        "data.num_train=24",
        "data.num_eval=8",
        f"data.dir={tmp_path}",
        "data.spec_prompts_path=data:prompts.jsonl",
    ]
    cfg = resolve_run(load_config(overrides=overrides), cuda_count=0).cfg
    assert cfg.data.spec_prompts_path == str(tmp_path / "prompts.jsonl")
    assert spec_prompts(cfg) == load_data(cfg)[2] == [[5, 6, 7], [9, 1]]


def test_a_spec_prompts_file_that_cannot_be_read_is_one_config_error(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt here"}\n')
    for path, said in (
        (tmp_path / "bad.jsonl", "prompts line 1: expected a JSON object"),
        (tmp_path / "no", "No such"),
    ):
        cfg = resolve_run(
            load_config(overrides=["data.source=random", f"data.spec_prompts_path={path}"]), cuda_count=0
        ).cfg
        with pytest.raises(ConfigError, match=f"data.spec_prompts_path {path}: .*{said}"):
            load_data(cfg)


def test_eval_finds_the_runs_bytecode_cache_from_its_config_and_none_without_one(tmp_path):
    (tmp_path / "config.resolved.yaml").write_text("run:\n  bytecode_cache_dir: /work/cache/bytecode\n")
    assert run_bytecode_dir(tmp_path) == "/work/cache/bytecode"
    assert run_bytecode_dir(tmp_path / "no-such-run") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.resolved.yaml").write_text("run: [\n")
    assert run_bytecode_dir(tmp_path / "bad") is None  # the evaluation reports the broken config itself


def test_prompt_rows_end_at_newlines_only_and_a_line_not_utf8_is_named(tmp_path):
    # U+2028 is valid raw inside a JSON string (data regen writes it so); str.splitlines() split
    # the row there. A byte that is not UTF-8 reached the tokenizer as a TypeError (exit 1).
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\r\n" + '{"input_ids": [1]}\n')
    assert [r["line"] for r in read_prompt_rows(path)] == [1, 2] and read_prompt_rows(path)[0][
        "prompt"
    ] == "a\u2028b\x85c"
    path.write_bytes(b'{"input_ids": [1]}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"^prompts line 2: not UTF-8$"):
        read_prompt_rows(path)


def test_the_report_says_which_prompts_it_decoded_with_their_rows_and_sha256(tmp_path, capsys, monkeypatch):
    """eval.json's `prompts_source`: the run's data.spec_prompts_path, or a --prompts file, by the
    name the CLI gives it (it sends the file on stdin), with its rows and the sha256 of its bytes."""
    own = tmp_path / "own.jsonl"
    own.write_bytes(b'{"input_ids": [5, 6, 7]}\n\n{"input_ids": [9, 1, 4]}\n')
    out = tmp_path / "run"
    overrides = [f"run.output_dir={out}", "run.steps=10", "run.eval_every=10", "run.checkpoint_every=10"]
    assert run_training(load_config(overrides=[*overrides, f"data.spec_prompts_path={own}"]), log=print) == 0
    capsys.readouterr()
    assert evaluate([str(out), "--max-new-tokens", "4", "--no-baseline"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    sha = hashlib.sha256(own.read_bytes()).hexdigest()
    assert report["prompts_source"] == {"from": "data.spec_prompts_path", "file": str(own), "rows": 2, "sha256": sha}
    given = b'{"input_ids": [3, 4, 5, 6]}\n'
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(given)))
    argv = [str(out), "--prompts", "-", "--prompts-name", "mine.jsonl", "--max-new-tokens", "4", "--report", "e.json"]
    assert evaluate([*argv, "--no-baseline"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["prompts_source"] == {
        "from": "--prompts",
        "file": "mine.jsonl",
        "rows": 1,
        "sha256": hashlib.sha256(given).hexdigest(),
    }


def test_a_jsonl_runs_own_prompts_are_its_eval_file_or_the_split_of_its_train_file(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [3, 4]}\n{"input_ids": [5, 6]}\n')
    held.write_bytes(b'{"input_ids": [7, 8]}\n')
    data = SimpleNamespace(source="jsonl", spec_prompts_path=None, eval_path=None, train_path=str(train))
    data.eval_fraction = 0.05
    cfg = SimpleNamespace(data=data, run=SimpleNamespace(seed=0))
    assert run_prompts_source(cfg) == {
        "from": "the held-out split (0.05) of data.train_path",
        "file": str(train),
        "rows": 3,
        "sha256": hashlib.sha256(train.read_bytes()).hexdigest(),
    }
    data.eval_path = str(held)
    assert run_prompts_source(cfg)["from"] == "the held-out data.eval_path"
    assert run_prompts_source(cfg)["rows"] == 1
