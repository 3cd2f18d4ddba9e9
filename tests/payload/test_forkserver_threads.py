"""The fork server names the native threads a fork leaves behind (forkserver.native_threads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"

# A new process, so that no thread of the test run's own comes or goes between the two counts.
COUNT = """
import json, threading
from dflash_train.forkserver import native_threads
alone = native_threads()
release, ready = threading.Event(), threading.Event()
worker = threading.Thread(target=lambda: (ready.set(), release.wait()))
worker.start()
ready.wait()
beside = native_threads()
release.set()
worker.join()
print(json.dumps([alone, beside]))
"""


def test_native_threads_names_each_thread_but_the_callers():
    said = subprocess.run([sys.executable, "-c", COUNT], cwd=PAYLOAD, capture_output=True, text=True, check=True)
    alone, beside = json.loads(said.stdout)
    assert alone == []
    assert len(beside) == 1 and beside[0]
