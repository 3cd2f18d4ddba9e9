"""Whole log lines (lines.py): under PYTHONUNBUFFERED=1 (runctl sets it) print() writes the text and
its newline in two writes, between which another writer of train.log (a hook's relay, another
rank) can land; the payload's programs write each line in one."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.lines import say

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"

# Runs a payload program with each of its standard streams over a raw file that reports every write
# it is given as one JSON line on the real stream: the text layer keeps the settings that
# PYTHONUNBUFFERED gave the interpreter's own (write-through), so what the program does to them counts.
RECORDING = """
import io, json, os, runpy, sys
class Recorder(io.RawIOBase):
    def __init__(self, fd):
        self.fd = fd
    def writable(self):
        return True
    def write(self, b):
        os.write(self.fd, json.dumps(bytes(b).decode()).encode() + b"\\n")
        return len(b)
for name, fd in (("stdout", 1), ("stderr", 2)):
    old = getattr(sys, name)
    setattr(sys, name, io.TextIOWrapper(
        Recorder(fd), encoding="utf-8", write_through=old.write_through, line_buffering=old.line_buffering
    ))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def writes(stream: str) -> list[str]:
    return [json.loads(line) for line in stream.splitlines()]


@pytest.mark.parametrize(
    "argv, stream, expected",
    [
        (["dflash_train", "--preflight"], "stdout", '{"ok": true'),
        (["dflash_train", "--set", "run.steps=0"], "stderr", "error: run.steps must be positive"),
        (["dflash_train.regen", "--prompts", "missing.jsonl", "--out", "o.jsonl"], "stderr", "error: "),
        (["dflash_train.evaluate", "--count", "0", "no-run"], "stderr", "--count must be at least 1"),
    ],
    ids=["trainer stdout", "trainer stderr", "regen", "evaluate"],
)
def test_each_line_a_program_prints_reaches_the_stream_in_one_write(argv, stream, expected):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RECORDING, *argv], cwd=PAYLOAD, env=env, capture_output=True, text=True, timeout=120
    )
    chunks = writes(getattr(proc, stream))
    assert any(expected in chunk for chunk in chunks), proc
    assert all(chunk.endswith("\n") for chunk in chunks), chunks


class Recorder(io.RawIOBase):
    def __init__(self):
        self.chunks: list[bytes] = []

    def writable(self):
        return True

    def write(self, b):
        self.chunks.append(bytes(b))
        return len(b)


def test_say_writes_the_line_and_its_newline_at_once_on_a_write_through_stream(monkeypatch):
    raw = Recorder()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    print("step 1")  # what the trainer's log was: two writes
    say("step 2")
    assert raw.chunks == [b"step 1", b"\n", b"step 2\n"]
