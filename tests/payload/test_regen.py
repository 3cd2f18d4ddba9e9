"""`python -m dflash_train.regen` (issue 16) in-process: greedy output against the target's own
greedy continuation, the errors file, exact resume from a torn partial, chat rows through a
tokenizer (thinking on/off), and the openai engine against the stand-in server with retries."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_data import CHATS, save_tokenizer

from dflash_train import regen
from dflash_train.config import TargetConfig
from dflash_train.target import build_tiny_target

STANDIN = Path(__file__).resolve().parents[1] / "shims" / "openai_standin.py"


def write_rows(path: Path, rows: list) -> Path:
    """JSONL rows (a str is written as a raw line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def token_prompts(n: int) -> list[dict]:
    """n token-id prompts of different lengths (a batch is left-padded)."""
    return [{"input_ids": [(5 + i * 37 + j * 11) % 500 for j in range(3 + i % 5)]} for i in range(n)]


def reference_greedy(prompt: list[int], new: int) -> list[int]:
    """The tiny target's greedy continuation, one full forward per token (no cache, no batch),
    never the reserved MASK id: independent of the decode path under test."""
    target = build_tiny_target(TargetConfig(), 0)
    ids = list(prompt)
    for _ in range(new):
        logits = target.logits(torch.tensor([ids]))[0, -1]
        logits[target.cfg.vocab_size - 1] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_rows_are_the_targets_own_continuation_and_failures_go_to_the_errors_file(tmp_path, capsys):
    prompts = token_prompts(7)
    rows = prompts[:3] + ["{not json", {"input_ids": [1] * 60}, {"text": "no known key"}] + prompts[3:]
    src = write_rows(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code = regen.main(
        [
            "--prompts",
            str(src),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
            "--batch-size",
            "3",
            "--set",
            "target.max_position_embeddings=64",
            "--metrics",
            str(tmp_path / "m.jsonl"),
        ]
    )
    assert code == 0
    got = read_jsonl(out)
    assert [r["index"] for r in got] == [0, 1, 2, 6, 7, 8, 9]
    for row, prompt in zip(got, prompts):
        new = reference_greedy(prompt["input_ids"], 6)
        assert row["input_ids"] == prompt["input_ids"] + new
        assert row["loss_mask"] == [0] * len(prompt["input_ids"]) + [1] * 6 and row["finish_reason"] == "length"
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [e["index"] for e in errors] == [3, 4, 5]
    assert errors[0]["reason"].startswith("not JSON")
    assert errors[1]["reason"] == "prompt of 60 tokens + 6 new ones exceeds the target's context of 64"
    assert errors[2]["reason"] == "row has none of messages, prompt, input_ids"
    assert not (tmp_path / ".out.jsonl.partial").exists()
    log = capsys.readouterr().out
    assert "regen: 10/10 rows (100%), 3 failed" in log and "failed rows: " in log
    last = read_jsonl(tmp_path / "m.jsonl")[-1]
    assert (last["rows_done"], last["rows_total"], last["rows_failed"]) == (10, 10, 3)
    assert last["gpu_mem_gb"] is None  # on the CPU: no device memory to read
    # A finished output is not overwritten; resuming it is a no-op.
    assert regen.main(["--prompts", str(src), "--out", str(out)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert regen.main(["--prompts", str(src), "--out", str(out), "--resume"]) == 0


def test_resume_from_a_torn_partial_gives_the_uninterrupted_file(tmp_path, capsys):
    """Sampled, so that a redone batch must draw exactly as it did: rows 0-6 written (batch 2 of
    3-row batches half done), row 7 torn mid-line, as a kill -9 can leave it."""
    rows = token_prompts(11) + ["garbage"]
    src = write_rows(tmp_path / "p.jsonl", rows)
    opts = [
        "--prompts",
        str(src),
        "--max-new-tokens",
        "5",
        "--batch-size",
        "3",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "7",
    ]
    assert regen.main([*opts, "--out", str(tmp_path / "ref.jsonl")]) == 0
    ref = (tmp_path / "ref.jsonl").read_bytes()
    lines = ref.decode().splitlines(keepends=True)
    partial = tmp_path / ".res.jsonl.partial"
    partial.write_text("".join(lines[:7]) + lines[7][: len(lines[7]) // 2])
    assert regen.main([*opts, "--out", str(tmp_path / "res.jsonl")]) == 2  # a partial is left: resume it, not over it
    capsys.readouterr()
    assert regen.main([*opts, "--out", str(tmp_path / "res.jsonl"), "--resume"]) == 0
    assert "regen: resuming at row 7/12: batch 2 runs again from row 6" in capsys.readouterr().out
    assert (tmp_path / "res.jsonl").read_bytes() == ref
    assert (tmp_path / "res.errors.jsonl").read_bytes() == (tmp_path / "ref.errors.jsonl").read_bytes()
    assert len(set(lines)) == len(lines) == 11  # distinct rows: a duplicate could not hide


def test_a_damaged_line_inside_the_partial_is_refused(tmp_path, capsys):
    src = write_rows(tmp_path / "p.jsonl", token_prompts(4))
    (tmp_path / ".o.jsonl.partial").write_text('{"index": 0}\nbroken\n{"index": 2}\n')
    assert regen.main(["--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), "--resume"]) == 2
    assert "line 2 is damaged" in capsys.readouterr().err


def test_bad_options_are_one_line_exit_2(tmp_path, capsys):
    src = write_rows(tmp_path / "p.jsonl", token_prompts(2))
    cases = [
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (
            ["--engine", "openai"],
            "--engine openai needs --endpoint URL (reachable from the container) and --model NAME",
        ),
        (["--set", "drafter.num_layers=2"], "regen takes target.*, run.dtype and run.cpu_threads"),
        (["--set", "target.num_layers=x"], "target.num_layers must be int"),
        (["--gpus", "0"], "CUDA is not available"),
    ]
    for extra, message in cases:
        assert regen.main(["--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), *extra]) == 2
        assert message in capsys.readouterr().err
    chats = write_rows(tmp_path / "c.jsonl", [{"messages": CHATS[1]}])
    assert regen.main(["--prompts", str(chats), "--out", str(tmp_path / "o.jsonl"), "--preflight"]) == 2
    assert json.loads(capsys.readouterr().out) == {
        "ok": False,
        "error": "config",
        "message": f"{chats} has messages rows (the first on line 1), which need a tokenizer: --tokenizer DIR, or "
        "target.path",
    }
    assert regen.main(["--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), "--preflight"]) == 0
    answer = json.loads(capsys.readouterr().out)  # the trainer's pre-flight format (plan.preflight_answer)
    assert {k: answer[k] for k in ("ok", "holds", "pin", "devices")} == {
        "ok": True,
        "holds": ["cpu"],
        "pin": [],
        "devices": ["cpu"],
    }
    assert answer["summary"] == [
        "engine: builtin, target random 6 layers, fp32, devices cpu (run.device auto: no CUDA)"
    ]
    assert answer["plan"]["devices"] == ["cpu"] and "gpus" not in answer


def test_a_row_that_needs_a_tokenizer_after_the_first_is_refused_before_the_run(tmp_path, capsys):
    # The first row (input_ids) needs none; line 4 (row 2: a blank line is no row) does.
    src = write_rows(tmp_path / "p.jsonl", [*token_prompts(2), "", {"messages": CHATS[1]}, *token_prompts(2)])
    out = tmp_path / "o.jsonl"
    assert regen.main(["--prompts", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: {src} has messages rows (the first on line 4), which need a tokenizer: --tokenizer DIR, "
        "or target.path\n"
    )
    assert list(tmp_path.iterdir()) == [src]  # refused before the run: no partial, no errors file


def test_the_openai_engine_refuses_a_later_token_row_without_a_tokenizer(tmp_path, capsys):
    src = write_rows(tmp_path / "c.jsonl", [{"messages": CHATS[1]}, {"messages": CHATS[1]}, {"input_ids": [5, 6]}])
    argv = ["--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), "--engine", "openai", "--preflight"]
    assert regen.main([*argv, "--endpoint", "http://127.0.0.1:9", "--model", "m"]) == 2
    message = json.loads(capsys.readouterr().out)["message"]
    assert message.startswith(f"{src} has input_ids rows (the first on line 3), which come back as text"), message


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_rows_get_the_targets_reply_with_thinking_on_or_off(tmp_path):
    tok = save_tokenizer(tmp_path / "tok", chat_template=THINK_TEMPLATE)
    vocab = len(tok)
    chats = [{"messages": CHATS[0]}, {"messages": CHATS[1][:1]}, {"messages": [{"role": "system", "content": "x"}]}]
    src = write_rows(tmp_path / "chats.jsonl", chats)
    sets = ["--set", f"target.vocab_size={vocab}", "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens", "8"]
    target_cfg = TargetConfig(vocab_size=vocab)
    mask = tok.convert_tokens_to_ids("<|MASK|>")
    eos = tok.eos_token_id

    def expected(convo: list[dict], thinking: bool | None) -> str:
        extra = {} if thinking is None else {"enable_thinking": thinking}
        text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **extra)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        target = build_tiny_target(target_cfg, 0)
        new = []
        while len(new) < 8 and (not new or new[-1] != eos):
            logits = target.logits(torch.tensor([ids + new]))[0, -1]
            logits[mask] = float("-inf")
            new.append(int(logits.argmax()))
        return tok.decode(new, skip_special_tokens=True)

    replies = {}
    for thinking in (None, False):
        out = tmp_path / f"chat-{thinking}.jsonl"
        flag = [] if thinking is None else ["--thinking", "off"]
        assert regen.main(["--prompts", str(src), "--out", str(out), *sets, *flag]) == 0
        got = read_jsonl(out)
        assert [r["index"] for r in got] == [0, 1]
        convo = CHATS[0][:4]  # up to the last user turn: the old answer is replaced
        assert got[0]["messages"][:4] == convo and got[0]["messages"][4]["role"] == "assistant"
        assert got[0]["messages"][4]["content"] == expected(convo, thinking)
        assert got[1]["messages"][1]["content"] == expected(CHATS[1][:1], thinking)
        replies[thinking] = got[0]["messages"][4]["content"]
        assert read_jsonl(tmp_path / f"chat-{thinking}.errors.jsonl") == [
            {"index": 2, "reason": "messages has no user turn to answer"}
        ]
    assert replies[None] != replies[False]  # the flag reached the template


@pytest.fixture
def standin(tmp_path):
    """Start the stand-in server (failing its first 2 requests: 500, then 429); yields (url, log path)."""
    procs = []

    def start(fail: int = 2, statuses: str = "500,429", hold_until: Path | None = None) -> tuple[str, Path]:
        port_file, log = tmp_path / f"port{len(procs)}", tmp_path / f"requests{len(procs)}.jsonl"
        argv = [sys.executable, str(STANDIN), "--port-file", str(port_file), "--fail", str(fail)]
        argv += ["--fail-status", statuses, "--log", str(log)]
        procs.append(subprocess.Popen(argv + (["--hold-until", str(hold_until)] if hold_until else [])))
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port_file.read_text()}", log

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_openai_engine_retries_and_keeps_rows_in_order(tmp_path, standin, capsys):
    url, log = standin(fail=2)
    chats = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    chats[3] = {"messages": [{"role": "user", "content": "FAIL-ROW please"}]}
    src = write_rows(tmp_path / "chats.jsonl", chats)
    out = tmp_path / "oa.jsonl"
    code = regen.main(
        [
            "--prompts",
            str(src),
            "--out",
            str(out),
            "--engine",
            "openai",
            "--endpoint",
            url + "/v1/",
            "--model",
            "standin",
            "--concurrency",
            "3",
            "--seed",
            "10",
            "--thinking",
            "on",
            "--max-new-tokens",
            "5",
        ]
    )
    assert code == 0, capsys.readouterr().err
    got = read_jsonl(out)
    assert [r["index"] for r in got] == [0, 1, 2, 4, 5]
    requests = read_jsonl(log)
    assert len(requests) == 6 + 2  # two were failed and retried
    bodies = {r["body"]["messages"][0]["content"]: r["body"] for r in requests}
    for row in got:
        body = bodies[f"question {row['index']}"]
        assert body["seed"] == 10 + row["index"] and body["max_tokens"] == 5 and body["model"] == "standin"
        assert body["chat_template_kwargs"] == {"enable_thinking": True}
        reply = row["messages"][-1]["content"]
        assert reply.startswith("<think>\nthinking ") and "\n</think>\n\n" in reply
        assert row["finish_reason"] == ("stop" if 3 + body["seed"] % 4 <= 5 else "length")
    (error,) = read_jsonl(tmp_path / "oa.errors.jsonl")
    assert error["index"] == 3 and error["reason"].startswith("HTTP 400 from chat/completions")


def test_openai_engine_needs_a_tokenizer_for_prompt_rows_and_fails_on_a_dead_server(tmp_path, standin, capsys):
    src = write_rows(tmp_path / "p.jsonl", [{"prompt": "once upon a time"}])
    base = ["--prompts", str(src), "--engine", "openai", "--model", "standin"]
    assert regen.main([*base, "--out", str(tmp_path / "a.jsonl"), "--endpoint", "http://127.0.0.1:9"]) == 2
    assert "needs --tokenizer DIR" in capsys.readouterr().err
    save_tokenizer(tmp_path / "tok")
    tok = ["--tokenizer", str(tmp_path / "tok")]
    assert (
        regen.main(
            [*base, *tok, "--out", str(tmp_path / "b.jsonl"), "--endpoint", "http://127.0.0.1:9", "--retries", "1"]
        )
        == 1
    )
    assert "after 2 attempts" in capsys.readouterr().err and (tmp_path / ".b.jsonl.partial").exists()
    url, _ = standin(fail=0)
    assert regen.main([*base, *tok, "--out", str(tmp_path / "b.jsonl"), "--endpoint", url, "--resume"]) == 0
    (row,) = read_jsonl(tmp_path / "b.jsonl")
    hf = save_tokenizer(tmp_path / "tok2")
    prompt_ids = hf("once upon a time")["input_ids"]
    assert row["input_ids"][: len(prompt_ids)] == prompt_ids and row["loss_mask"].count(0) == len(prompt_ids)
    assert hf.eos_token_id not in row["input_ids"] and row["finish_reason"] == "stop"  # none the server gave


def test_openai_engine_runs_on_the_standard_library_alone(tmp_path, standin):
    """A container without torch or any HTTP package: chat rows through the openai engine."""
    import venv

    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(tmp_path / "bare")
    python = tmp_path / "bare" / "bin" / "python"
    url, _ = standin(fail=1)
    src = write_rows(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    done = subprocess.run(
        [
            str(python),
            "-m",
            "dflash_train.regen",
            "--prompts",
            str(src),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--engine",
            "openai",
            "--endpoint",
            url,
            "--model",
            "standin",
        ],
        cwd=Path(regen.__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
    (row,) = read_jsonl(tmp_path / "o.jsonl")
    assert row["messages"][-1]["role"] == "assistant" and row["finish_reason"] in ("stop", "length")


def test_a_run_whose_rows_all_fit_in_the_first_round_ends_on_its_rate_since_the_start():
    """No batch came after the first round: the final line gives the rate since the start, marked,
    where it said `0 tok/s, ETA -`."""
    from dflash_train.regen_output import Progress

    now, lines = [0.0], []
    progress = Progress(128, 0, None, lines.append, workers=2, clock=lambda: now[0])
    now[0] = 10.0
    progress.update(64, 0, 4096)
    now[0] = 12.0
    progress.update(128, 0, 4096)  # the round's end: every row is in
    now[0] = 12.5
    progress.update(128, 0, 0, final=True)
    assert lines[-1] == "regen: 128/128 rows (100%), 0 failed, 655 tok/s incl. start-up, ETA 0:00"


def test_progress_measures_the_rate_after_the_first_round_of_batches(tmp_path):
    """Start-up (imports, the target's build, compiles) is not counted into the rate or the ETA:
    a simulated clock, two workers, 64-row batches of 4096 tokens every 2 s after a 20 s start."""
    from dflash_train.regen_output import Progress

    now, lines = [0.0], []
    metrics = tmp_path / "metrics.jsonl"
    progress = Progress(640, 0, metrics, lines.append, workers=2, clock=lambda: now[0], memory=lambda: 71.234)
    for batch, at in enumerate([20.0, 20.5, 22.5, 24.5, 26.5]):
        now[0] = at
        progress.update(64 * (batch + 1), 0, 4096)
    progress.update(320, 0, 0, final=True)
    assert lines[0] == "regen: 64/640 rows (10%), 0 failed, 205 tok/s incl. start-up, ETA 3:00"
    # From the second batch written (the round's end at 20.5 s): 3 batches in 6 s.
    assert lines[-1] == "regen: 320/640 rows (50%), 0 failed, 2,048 tok/s, ETA 0:10"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["rate_includes_start_up"] and not records[-1]["rate_includes_start_up"]
    assert records[-1]["tokens_per_s_since_start"] == round(5 * 4096 / 26.5, 1)
    assert records[-1]["gpu_mem_gb"] == 71.23  # the engine's peak, read at each record
