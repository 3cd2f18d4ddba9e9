"""`dflashctl data push/list` (issue 16) through sshd + the pct shim, and a run on a pushed dataset."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess

from runs_helpers import wait_until
from sshd import CLI, SHIM_VMID


def rows(n: int, seed: int = 0) -> str:
    """n JSONL rows of token ids the tiny target's vocabulary holds."""
    return "".join(json.dumps({"input_ids": [(seed + i * 7 + j) % 500 for j in range(40)]}) + "\n" for i in range(n))


def test_push_list_skip_unchanged_and_replace(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(rows(30))
    b.write_text(rows(12, seed=3))
    first = shim_host.run_cli("data", "push", "shim", str(a), str(b))
    assert first.returncode == 0, first.stderr
    assert (
        "a.jsonl: sent" in first.stdout and "30 rows" in first.stdout and "data.train_path=data:a.jsonl" in first.stdout
    )
    assert (data / "a.jsonl").read_bytes() == a.read_bytes()
    listed = json.loads(shim_host.run_cli("data", "list", "shim", "--json").stdout)
    sha = hashlib.sha256(a.read_bytes()).hexdigest()
    assert {d["name"]: (d["rows"], d["size"], d["sha256"]) for d in listed}["a.jsonl"] == (30, a.stat().st_size, sha)
    again = shim_host.run_cli("data", "push", "shim", str(a))
    assert "a.jsonl: unchanged" in again.stdout
    a.write_text(rows(31))
    changed = shim_host.run_cli("data", "push", "shim", str(a), "--as", "train")
    assert "train: sent" in changed.stdout and (data / "train").read_bytes() == a.read_bytes()
    table = shim_host.run_cli("data", "list", "shim").stdout.splitlines()
    assert table[0].split() == ["NAME", "KIND", "SIZE", "ROWS", "SHA256"]
    assert any(line.split()[:2] == ["train", "dataset"] for line in table)
    bad = shim_host.run_cli("data", "push", "shim", str(a), str(b), "--as", "x")
    assert bad.returncode == 2 and "--as names one file" in bad.stderr


def test_a_regen_errors_file_is_listed_as_such_and_refused_for_training(shim_host, tmp_path):
    """`data list` showed a regen's X.errors.jsonl (its failed rows) like a dataset, and `train`
    took it (failing only in the container). Listed as the errors of X.jsonl now; naming it for
    training, or pushing under such a name, is one line, exit 2, before anything changes."""
    work = shim_host.container_dir(SHIM_VMID) / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "chat-regen.jsonl").write_text(rows(3))  # as data regen leaves them
    (work / "data" / "chat-regen.errors.jsonl").write_text(json.dumps({"index": 1, "reason": "HTTP 400"}) + "\n")
    listed = {d["name"]: d for d in json.loads(shim_host.run_cli("data", "list", "shim", "--json").stdout)}
    assert listed["chat-regen.errors.jsonl"]["kind"] == "errors"
    assert listed["chat-regen.errors.jsonl"]["errors_of"] == "chat-regen.jsonl"
    assert listed["chat-regen.jsonl"]["kind"] == "dataset" and "errors_of" not in listed["chat-regen.jsonl"]
    table = [line.split() for line in shim_host.run_cli("data", "list", "shim").stdout.splitlines()]
    assert ["chat-regen.errors.jsonl", "errors", "of", "chat-regen.jsonl"] in [line[:4] for line in table]
    assert ["chat-regen.jsonl", "dataset"] in [line[:2] for line in table]
    sets = ["--set", "data.source=jsonl", "--set", "data.train_path=data:chat-regen.errors.jsonl"]
    train = shim_host.run_cli("train", "shim", *sets, "--detach")
    assert (train.returncode, train.stdout) == (2, "")
    assert train.stderr == (
        "error: trainer config: data.train_path=data:chat-regen.errors.jsonl is the errors file of a data regen "
        "(the rows that failed, {index, reason}), not a dataset: train on its output, data:chat-regen.jsonl\n"
    )
    assert not (work / "payload").exists() and not (work / "runs").exists()  # nothing pushed or started
    named = tmp_path / "mine.errors.jsonl"
    named.write_text(rows(2))
    push = shim_host.run_cli("data", "push", "shim", str(named))
    assert (push.returncode, push.stdout) == (2, "")
    assert push.stderr == (
        "error: dataset name 'mine.errors.jsonl': a name ending .errors.jsonl is a data regen's errors file "
        "(its failed rows), not a dataset: choose another\n"
    )
    assert not (work / "data" / "mine.errors.jsonl").exists()


def test_push_of_a_missing_file_or_a_directory_says_which(shim_host, tmp_path):
    for missing, why in (
        (tmp_path / "nope.jsonl", f"no such file: {tmp_path / 'nope.jsonl'}"),
        (tmp_path, f"{tmp_path} is a directory, not a file"),
    ):
        res = shim_host.run_cli("data", "push", "shim", str(missing))
        assert (res.returncode, res.stderr) == (2, f"error: {why}\n")


def test_a_killed_push_leaves_the_old_copy_and_no_partial(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    big = tmp_path / "big.jsonl"
    big.write_text(rows(10))
    assert shim_host.run_cli("data", "push", "shim", str(big)).returncode == 0
    old = big.read_bytes()
    with big.open("w") as fh:  # 300 MB of rows: the transfer is still going when it is killed
        fh.write((json.dumps({"prompt": "x" * (1 << 20)}) + "\n") * 300)  # long rows: quick to check
    proc = subprocess.Popen(
        [*CLI, "data", "push", "shim", str(big)],
        env=shim_host.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        lambda: any(p.name.startswith(".big.jsonl.partial.") and p.stat().st_size > (1 << 20) for p in data.iterdir()),
        120,
        "a partial transfer",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until(
        lambda: not any(p.name.startswith(".big.jsonl.partial.") for p in data.iterdir()),
        60,
        "the partial file to be removed",
    )
    assert (data / "big.jsonl").read_bytes() == old


def test_a_run_trains_on_a_pushed_dataset(shim_host, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(rows(40))
    assert shim_host.run_cli("data", "push", "shim", str(train), "--as", "mine").returncode == 0
    res = shim_host.run_cli(
        "train",
        "shim",
        "--set",
        "data.source=jsonl",
        "--set",
        "data.train_path=data:mine",
        "--set",
        "run.steps=4",
        "--set",
        "data.batch_size=4",
        "--set",
        "run.eval_every=4",
        "--follow",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "data: " + str(shim_host.container_dir(SHIM_VMID) / "work" / "data" / "mine") in res.stdout
    missing = shim_host.run_cli(
        "train", "shim", "--set", "data.source=jsonl", "--set", "data.train_path=data:nope", "--detach", timeout=300
    )
    assert missing.returncode == 2 and "data.train_path: no such file" in missing.stderr


def test_a_malformed_row_is_refused_before_anything_is_sent(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(rows(3))
    cases = [
        ('{"input_ids": [1, 2, 3]\n', "not JSON (Expecting ',' delimiter)"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}\n', "loss_mask has 1 entries, input_ids 2"),
        ('{"text": "no known field"}\n', "the row has none of input_ids, messages or prompt"),
        ("[1, 2]\n", "a row must be a JSON object, not list"),
        (
            '{"messages": [{"role": "user", "content": "hi"}], "reply_ids": [1.5]}\n',
            "reply_ids must be a non-empty flat list of token ids (integers >= 0)",
        ),
        # The trainer's embedding fails on a negative id (a device-side assert on CUDA), and its
        # JSON reader on a byte-order mark: both only once the run had started.
        ('{"input_ids": [5, -1, 7]}\n', "input_ids must be a non-empty flat list of token ids (integers >= 0)"),
        (
            '\ufeff{"input_ids": [1, 2]}\n',
            "a UTF-8 byte-order mark (BOM) before the row, which the trainer refuses: save the file without it",
        ),
    ]
    for row, why in cases:
        bad.write_text(rows(2) + "\n" + row + rows(1))  # line 4: after two rows and a blank line
        res = shim_host.run_cli("data", "push", "shim", str(good), str(bad))
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.splitlines() == [f"error: {bad}:4: {why}; nothing was pushed (row formats: docs/data.md)"]
        assert not (data / "good.jsonl").exists() and not (data / "bad.jsonl").exists()
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"prompt": "Once upon"})
        + "\n"
    )
    ok = shim_host.run_cli("data", "push", "shim", str(chat))
    assert ok.returncode == 0 and "chat.jsonl: sent" in ok.stdout and "2 rows" in ok.stdout


def test_the_use_hint_follows_the_rows_kind(shim_host, tmp_path):
    ids, chat, prompts, mixed = (tmp_path / n for n in ("ids.jsonl", "chat.jsonl", "prompts.jsonl", "mixed.jsonl"))
    ids.write_text(rows(3))
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    prompts.write_text(json.dumps({"prompt": "Once upon"}) + "\n")
    mixed.write_text(chat.read_text() + prompts.read_text())  # regen reads it; the trainer refuses prompt rows
    res = shim_host.run_cli("data", "push", "shim", str(ids), str(chat), str(prompts), str(mixed))
    assert res.returncode == 0, res.stderr
    hints = {line.split(":")[0]: line.split(" (", 1)[1] for line in res.stdout.splitlines()}
    counts = [line.split(", ")[2] for line in res.stdout.splitlines()]
    assert counts == ["3 rows", "1 row", "1 row", "2 rows"]  # a one-row file said "1 rows"
    train = "train on it with --set data.source=jsonl --set data.train_path=data:{})"
    assert hints["ids.jsonl"] == train.format("ids.jsonl") and hints["chat.jsonl"] == train.format("chat.jsonl")
    regen = (
        "prompt rows: have the target write the replies with dflashctl data regen shim --prompts {0} "
        "--out {1}-regen, or use them as --set data.spec_prompts_path=data:{0})"
    )
    assert hints["prompts.jsonl"] == regen.format("prompts.jsonl", "prompts")
    assert hints["mixed.jsonl"] == regen.format("mixed.jsonl", "mixed")
    again = shim_host.run_cli("data", "push", "shim", str(prompts), str(ids))  # unchanged: the same hints
    assert again.returncode == 0 and [line.split(" (", 1)[1] for line in again.stdout.splitlines()] == [
        regen.format("prompts.jsonl", "prompts"),
        train.format("ids.jsonl"),
    ]


def test_a_file_without_rows_is_refused_before_anything_is_sent(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    good, empty, blank = tmp_path / "good.jsonl", tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    good.write_text(rows(3))
    empty.write_text("")
    blank.write_text("\n  \n\t\n")
    for path in (empty, blank):
        res = shim_host.run_cli("data", "push", "shim", str(good), str(path))
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.splitlines() == [f"error: {path} has no rows; nothing was pushed"]
        assert not (data / "good.jsonl").exists() and not (data / path.name).exists()


def test_two_files_of_one_name_are_refused_before_either_is_sent(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"
    first.write_text(rows(5))
    second.write_text(rows(3, seed=1))
    res = shim_host.run_cli("data", "push", "shim", str(first), str(second))
    assert (res.returncode, res.stderr) == (
        2,
        f"error: {first} and {second} would both be data:x.jsonl (the second replacing the first); "
        "nothing was pushed: push one of them alone with --as NAME\n",
    )
    assert not (data / "x.jsonl").exists()


def test_an_empty_as_name_is_refused_not_ignored(shim_host, tmp_path):
    data = shim_host.container_dir(SHIM_VMID) / "work" / "data"
    path = tmp_path / "x.jsonl"
    path.write_text(rows(2))
    res = shim_host.run_cli("data", "push", "shim", str(path), "--as", "")
    assert (res.returncode, res.stdout) == (2, "") and res.stderr.startswith("error: dataset name '': ")
    assert not (data / "x.jsonl").exists()  # it was pushed under the file's own name
