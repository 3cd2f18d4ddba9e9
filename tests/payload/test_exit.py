"""A payload process's exit (`fast_exit.exit_now`): without the interpreter's teardown once nothing needs it,
with everything printed and the exit code kept; a non-daemon thread still at work is waited for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


def run(body: str) -> subprocess.CompletedProcess:
    code = "import atexit, threading, time\nfrom dflash_train.fast_exit import exit_now\n" + body
    return subprocess.run([sys.executable, "-c", code], cwd=PAYLOAD, capture_output=True, text=True, timeout=120)


def test_the_fast_exit_keeps_the_code_and_what_was_printed_and_skips_the_teardown():
    proc = run("atexit.register(lambda: print('teardown ran'))\nprint('last line', end='')\nexit_now(143)")
    assert proc.returncode == 143 and proc.stdout == "last line", proc


def test_a_thread_python_would_wait_for_is_waited_for():
    proc = run(
        "def work():\n"
        "    time.sleep(0.2)\n"
        "    print('worker finished', flush=True)\n"
        "threading.Thread(target=work).start()\n"
        "exit_now(1)"
    )
    assert proc.returncode == 1 and proc.stdout == "worker finished\n", proc
