"""The openai engine of `data regen` against the stand-in server (issue 28, item 3): a null
finish_reason, token rows holding only what the server returned, a torn 200 answer retried, an
answer without choices reported as such."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_data import save_tokenizer
from test_regen import STANDIN, read_jsonl, standin, write_rows  # noqa: F401 - standin is a fixture

from dflash_train import regen

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


def standin_module():
    """The stand-in server's module, for its deterministic `generate` (what it answers)."""
    spec = importlib.util.spec_from_file_location("openai_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def openai_args(src, out, url: str, *extra: str) -> list[str]:
    return [
        "--prompts",
        str(src),
        "--out",
        str(out),
        "--engine",
        "openai",
        "--endpoint",
        url,
        "--model",
        "standin",
        "--concurrency",
        "1",
        *extra,
    ]


def test_a_null_finish_reason_is_recorded_as_unknown_or_length_never_stop(tmp_path, standin, capsys):
    url, _ = standin(fail=0)
    # --seed 0: row i asks for 3 + i % 4 words, --max-new-tokens 4 caps them.
    chats = [
        {"messages": [{"role": "user", "content": "NULL-FINISH short"}]},  # 3 words
        {"messages": [{"role": "user", "content": "plain"}]},  # 4 words, the server says stop
        {"messages": [{"role": "user", "content": "NULL-FINISH long"}]},
    ]  # cut at 4
    src = write_rows(tmp_path / "c.jsonl", chats)
    out = tmp_path / "o.jsonl"
    assert regen.main(openai_args(src, out, url, "--max-new-tokens", "4")) == 0, capsys.readouterr().err
    assert [r["finish_reason"] for r in read_jsonl(out)] == ["unknown", "stop", "length"]


def test_token_rows_hold_exactly_the_tokens_of_the_servers_text(tmp_path, standin, capsys):
    url, log = standin(fail=0)
    hf = save_tokenizer(tmp_path / "tok")
    src = write_rows(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}, {"prompt": "NULL-FINISH once"}])
    out = tmp_path / "t.jsonl"
    assert (
        regen.main(openai_args(src, out, url, "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens", "16")) == 0
    ), capsys.readouterr().err
    module = standin_module()
    for row, request in zip(read_jsonl(out), read_jsonl(log)):
        body = request["body"]
        words, finish = module.generate(body, json.dumps(body["prompt"]))
        prompt = body["prompt"] if isinstance(body["prompt"], list) else hf(body["prompt"])["input_ids"]
        new = hf(" " + " ".join(words), add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == prompt + new  # no end-of-text token the server never sent
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(new)
        assert row["finish_reason"] == ("unknown" if "NULL-FINISH" in str(body["prompt"]) else finish)
    assert hf.eos_token_id not in read_jsonl(out)[0]["input_ids"]


def test_a_torn_200_answer_is_retried_like_a_5xx(tmp_path, standin, capsys):
    url, log = standin(fail=1, statuses="200")
    src = write_rows(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert regen.main(openai_args(src, tmp_path / "a.jsonl", url)) == 0, capsys.readouterr().err
    assert len(read_jsonl(log)) == 2 and not (tmp_path / "a.errors.jsonl").exists()
    (row,) = read_jsonl(tmp_path / "a.jsonl")
    assert row["messages"][-1]["role"] == "assistant" and row["finish_reason"] == "stop"
    url, _ = standin(fail=5, statuses="200")  # torn through every attempt: the run stops, resumable
    assert regen.main(openai_args(src, tmp_path / "b.jsonl", url, "--retries", "1")) == 1
    err = capsys.readouterr().err
    assert "an answer that is not JSON" in err and "after 2 attempts" in err
    assert (tmp_path / ".b.jsonl.partial").exists() and not (tmp_path / "b.jsonl").exists()


def test_an_answer_without_choices_is_that_rows_error_named_as_such(tmp_path, standin, capsys):
    url, _ = standin(fail=0)
    src = write_rows(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "NO-CHOICES"}]},
            {"messages": [{"role": "user", "content": "fine"}]},
        ],
    )
    assert regen.main(openai_args(src, tmp_path / "o.jsonl", url)) == 0, capsys.readouterr().err
    assert [r["index"] for r in read_jsonl(tmp_path / "o.jsonl")] == [1]
    (error,) = read_jsonl(tmp_path / "o.errors.jsonl")
    assert error == {
        "index": 0,
        "reason": 'the server\'s answer from chat/completions has no choices: {"id": '
        '"standin", "object": "error", "message": "stand-in: no choices"}',
    }


def test_a_reasoning_content_that_is_not_text_fails_that_row_not_the_run(tmp_path, standin, capsys):
    url, _ = standin(fail=0)
    src = write_rows(
        tmp_path / "r.jsonl",
        [
            {"messages": [{"role": "user", "content": "ODD-REASONING"}]},
            {"messages": [{"role": "user", "content": "fine"}]},
        ],
    )
    assert regen.main(openai_args(src, tmp_path / "o.jsonl", url)) == 0, capsys.readouterr().err
    assert [r["index"] for r in read_jsonl(tmp_path / "o.jsonl")] == [1]
    (error,) = read_jsonl(tmp_path / "o.errors.jsonl")
    assert error["index"] == 0 and error["reason"].startswith("the server's reasoning_content is not text: ")


def test_a_run_whose_every_row_failed_writes_no_dataset_and_exits_2(tmp_path, standin, capsys):
    url, _ = standin(fail=0)
    src = write_rows(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)])
    out = tmp_path / "oa.jsonl"
    args = openai_args(src, out, url)
    args[args.index("standin")] = "no-such-model"  # what the server answers each row with a 404
    assert regen.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: all 3 rows failed, so no dataset was written (row 0: HTTP 404 from chat/completions")
    assert "no-such-model" in err and "\n" not in err
    assert not out.exists() and not (tmp_path / ".oa.jsonl.partial").exists()
    assert [e["index"] for e in read_jsonl(tmp_path / "oa.errors.jsonl")] == [0, 1, 2]
    assert regen.main(openai_args(src, out, url)) == 0  # the name is free for the corrected run
    assert len(read_jsonl(out)) == 3 and not (tmp_path / "oa.errors.jsonl").exists()


def test_a_server_that_accepts_and_never_answers_gets_a_note_before_the_row_finishes(tmp_path, standin):
    """Each attempt waits up to REQUEST_TIMEOUT_S in silence; the run says so while it waits. The
    stand-in holds the request until the test, having seen the note, lets it answer."""
    release = tmp_path / "release"
    url, _ = standin(fail=0, hold_until=release)
    src = write_rows(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "HOLD this one"}]}])
    out = tmp_path / "o.jsonl"
    code = "import sys\nfrom dflash_train import regen\nregen.QUIET_S = 0.2\nsys.exit(regen.main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *openai_args(src, out, url)],
        cwd=PAYLOAD,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("no row finished" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, (lines, proc.poll())
            time.sleep(0.05)
        release.touch()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    reader.join(timeout=60)
    note = next(line for line in lines if "no row finished" in line)
    assert note.startswith("regen: no row finished in the last "), note
    assert note.endswith(f" s; 1 request waiting on {url}/v1 (each gives up after 600 s, then retries 8 times)\n"), note
    assert lines.index(note) < next(i for i, line in enumerate(lines) if line.startswith("regen: 1/1 rows"))
    assert len(read_jsonl(out)) == 1
