"""Whether the fork server's preload leaves a process a CUDA trainer can be forked from, import by
import, and what a fork saves: prints a JSON line per import, then the report as one JSON line
(docs/performance.md, issue 31).

For each of the fork server's PRELOAD modules in turn: import it (torch told to ask NVML, as the
server does), then start the CUDA driver in a forked child (cuInit; 0 = started). Then the server's
own self-check, and a forked child that uses CUDA and compiles, timed from the fork, against a new
process's import of the same modules.

    python3 bench/fork_probe.py
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote_payload"))

from dflash_train import forkserver  # noqa: E402


# In a new process: the import during which a thread named cuda* (the CUDA driver's) first appears,
# with the stack of imports that led there, or null.
WHO_STARTS_CUDA = """
import builtins, json, os, sys, traceback
os.environ[sys.argv[1]] = "1"
real, found, stack = builtins.__import__, [], []

def cuda_thread():
    for t in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/comm" % t) as comm:
                if comm.read().startswith("cuda"):
                    return True
        except OSError:
            pass
    return False

def watched(name, *args, **kwargs):
    stack.append(name)
    try:
        return real(name, *args, **kwargs)
    finally:
        if not found and cuda_thread():
            found.append({"imports": list(stack), "where": traceback.format_stack(limit=12)})
        stack.pop()

builtins.__import__ = watched
for name in sys.argv[2:]:
    __import__(name)
print(json.dumps(found[0] if found else None))
"""


def child_uses_cuda() -> dict:
    """In a forked child, with the environment a plain trainer has: CUDA, a matmul, a compiled function."""
    import torch

    os.environ.pop(forkserver.NVML_CHECK, None)
    t0 = time.perf_counter()
    out = {"cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        x = torch.randn(1024, 1024, device="cuda")
        torch.cuda.synchronize()
        out["first_cuda_s"] = round(time.perf_counter() - t0, 3)
        f = torch.compile(lambda a: (a @ a).relu().sum())
        out["compiled_value_finite"] = bool(torch.isfinite(f(x)).item())
        out["compiled_s"] = round(time.perf_counter() - t0, 3)
    return out


def reported(fn) -> str:
    """fn()'s answer as JSON, or how it failed (the probe reports whatever the child met)."""
    try:
        return json.dumps(fn())
    except BaseException as exc:
        return json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)})


def main() -> int:
    """Probe each import, the self-check, and a forked CUDA child; one JSON line."""
    report: dict = {"steps": []}
    t0 = time.perf_counter()
    code = "import " + ", ".join(forkserver.PRELOAD)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(forkserver.__file__).parents[1])
    report["fresh_process_import_s"] = round(time.perf_counter() - t0, 2)
    os.environ[forkserver.NVML_CHECK] = "1"
    for name in forkserver.PRELOAD:
        t = time.perf_counter()
        importlib.import_module(name)
        threads = forkserver.native_threads()
        step = {
            "import": name,
            "s": round(time.perf_counter() - t, 2),
            "cuinit_in_fork": forkserver.in_fork(forkserver.cuinit),
        }
        step["native_threads"] = threads
        report["steps"].append(step)
        print(json.dumps(step), flush=True)
    who = subprocess.run(
        [sys.executable, "-c", WHO_STARTS_CUDA, forkserver.NVML_CHECK, *forkserver.PRELOAD],
        cwd=Path(forkserver.__file__).parents[1],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        report["first_cuda_thread"] = json.loads(who.stdout)
    except ValueError:
        report["first_cuda_thread"] = {"error": who.stderr.strip()[-500:]}
    print(json.dumps({"first_cuda_thread": report["first_cuda_thread"]}), flush=True)
    report["self_check_refusal"] = forkserver.fork_refusal()
    t = time.perf_counter()
    said = forkserver.in_fork(lambda: reported(child_uses_cuda))
    report["forked_child"] = json.loads(said) if said.startswith("{") else {"error": said}
    report["forked_child_wall_s"] = round(time.perf_counter() - t, 2)
    print(json.dumps(report), flush=True)
    return 0 if report["self_check_refusal"] is None and report["forked_child"].get("cuda_available") else 1


if __name__ == "__main__":
    sys.exit(main())
