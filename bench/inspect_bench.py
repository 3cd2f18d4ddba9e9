"""Benchmark `dflashctl inspect` against the field notes' ssh one-liner, through real sshd + pct shim.

Run from the repo root:  python bench/inspect_bench.py [--runs 7] [--lines 1825:1888] [--persist N]

It starts a throwaway OpenSSH sshd on 127.0.0.1 with the `pct` shim (tests/sshd.py, the same
harness the tests use; container 200's interpreter is this Python, so torch is importable there)
and times, as the median wall time of --runs runs each:
  (a) the one-liner: system `ssh` -> `pct exec 200 -- /bin/bash -lc '... python - <<PY'` that
      imports torch._inductor.compile_fx and prints the lines from inspect.getsource;
  (b) `dflashctl inspect compile_fx --lines A:B`, cold (client cache emptied before each run);
  (c) the same, warm (cache filled);
with --persist N also (d) cold and (e) warm with `persist: N` on the host, i.e. through the
background mux that keeps the SSH connection between calls (started by an untimed first run,
stopped with `hosts disconnect --all` at the end).
(f) is the floor: ssh + pct exec + a python that only reads the file's lines.
It checks that all of them print the same lines, then prints a markdown table with the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sshd import SHIM_VMID, SshdHost  # noqa: E402

GOALS = {"cold": 8.0, "warm": 15.0}


def one_liner(host: SshdHost, first: int, last: int) -> list[str]:
    """The field notes' command, adapted to the shim host (its interpreter instead of a venv)."""
    script = (
        "import inspect\n"
        "import torch._inductor.compile_fx as cfx\n"
        "src=inspect.getsource(cfx).splitlines()\n"
        f"for i in range({first},{last + 1}):\n"
        '    print(f"{i}: {src[i-1]}")\n'
    )
    inner = f"{shlex.quote(sys.executable)} - <<'PY'\n{script}PY"
    remote = shlex.join([str(host.pct_path), "exec", str(SHIM_VMID), "--", "/bin/bash", "-lc", inner])
    return [
        "ssh", "-F", "/dev/null", "-i", str(host.home / ".ssh" / "id_ed25519"),
        "-o", f"UserKnownHostsFile={host.home / '.ssh' / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", str(host.port),
        f"{host.user}@{host.address}", remote,
    ]  # fmt: skip


def bare_read(host: SshdHost, path: str, first: int, last: int) -> list[str]:
    """The floor: ssh + pct exec + a python that only reads the lines of the known file (no torch)."""
    script = (f"lines = open({path!r}).read().splitlines()\n"
              f"for i in range({first}, {last + 1}): print(f'{{i}}: {{lines[i - 1]}}')")
    remote = shlex.join([str(host.pct_path), "exec", str(SHIM_VMID), "--", sys.executable, "-S", "-c", script])
    return one_liner(host, first, last)[:-1] + [remote]


def cli_argv(spec: str) -> list[str]:
    """The installed console script next to this interpreter (what an activated venv runs)."""
    script = Path(sys.executable).parent / "dflashctl"
    return [str(script), "inspect", "compile_fx", "--lines", spec]


def timed(argv: list[str], env: dict[str, str], before=None) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Wall time and stdout of one run (before() runs first, untimed)."""
    if before:
        before()
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(argv)[:200]}\n{proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def measure(argv: list[str], env: dict[str, str], runs: int, before=None) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Median wall time over runs, and the output of the last run."""
    times, out = [], ""
    for _ in range(runs):
        elapsed, out = timed(argv, env, before)
        times.append(elapsed)
    return statistics.median(times), out


def compile_fx_path() -> str:
    """torch/_inductor/compile_fx.py of the installed torch, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec and spec.submodule_search_locations
    return str(Path(spec.submodule_search_locations[0]) / "_inductor" / "compile_fx.py")


def torch_version() -> str:
    """Installed torch version, read from torch/version.py without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec and spec.submodule_search_locations
    text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    return text.split("__version__ = ", 1)[1].split("\n", 1)[0].strip("'\"")


def main() -> None:
    """Time the one-liner and `dflashctl inspect` (cold/warm cache, optionally via a mux); print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--lines", default="1825:1888")
    parser.add_argument("--persist", type=int, default=60,
                        help="also time the host with `persist: N` (a mux; 60 is hosts.yaml's default; 0: not)")
    args = parser.parse_args()
    first, last = (int(x) for x in args.lines.split(":"))
    with tempfile.TemporaryDirectory(prefix="inspect-bench-") as tmp:
        host = SshdHost(Path(tmp) / "sshd", "127.0.0.1").start()
        try:
            cache = Path(tmp) / "cache"
            env = {**host.env, "XDG_CACHE_HOME": str(cache)}
            clear = lambda: shutil.rmtree(cache, ignore_errors=True)  # noqa: E731
            timed(one_liner(host, first, last), env)  # warm the page cache for torch's files
            a, out_a = measure(one_liner(host, first, last), env, args.runs)
            b, out_b = measure(cli_argv(args.lines), env, args.runs, before=clear)
            c, out_c = measure(cli_argv(args.lines), env, args.runs)
            f, _ = measure(bare_read(host, compile_fx_path(), first, last), env, args.runs)
            d = e = 0.0
            out_d = out_e = out_a
            if args.persist:
                runtime = Path(tmp) / "rt"
                runtime.mkdir(mode=0o700)
                penv = {**env, "XDG_RUNTIME_DIR": str(runtime)}
                host.write_inventory(extra_hosts={"shim": host.host_entry(SHIM_VMID, persist=args.persist)})
                try:
                    timed(cli_argv(args.lines), penv)  # starts the mux
                    d, out_d = measure(cli_argv(args.lines), penv, args.runs, before=clear)
                    e, out_e = measure(cli_argv(args.lines), penv, args.runs)
                finally:
                    subprocess.run([*cli_argv("1")[:1], "hosts", "disconnect", "--all"], env=penv, capture_output=True)
        finally:
            host.stop()
    if not out_a == out_b == out_c == out_d == out_e:
        raise SystemExit("outputs differ between the one-liner and dflashctl inspect")
    print(f"{date.today()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch_version()}, "
          f"median of {args.runs}, lines {args.lines} ({len(out_a.splitlines())} lines, identical output)\n")  # fmt: skip
    print("| run | median wall time | speed-up vs (a) | goal |")
    print("|---|---|---|---|")
    print(f"| (a) ssh + pct exec + bash -lc + python importing torch | {a * 1000:.0f} ms | 1.0x | |")
    for label, value, goal in (("(b) dflashctl inspect, cold cache, persist: 0", b, "cold"),
                               ("(c) dflashctl inspect, warm cache, persist: 0", c, "warm")):
        ratio = a / value
        verdict = "met" if ratio >= GOALS[goal] else "MISSED"
        print(f"| {label} | {value * 1000:.0f} ms | {ratio:.1f}x | >= {GOALS[goal]:.0f}x {verdict} |")
    if args.persist:
        for label, value, goal in ((f"(d) dflashctl inspect, cold cache, persist: {args.persist}", d, "cold"),
                                   (f"(e) dflashctl inspect, warm cache, persist: {args.persist}", e, "warm")):  # fmt: skip
            ratio = a / value
            verdict = "met" if ratio >= GOALS[goal] else "MISSED"
            print(f"| {label} | {value * 1000:.0f} ms | {ratio:.1f}x | >= {GOALS[goal]:.0f}x {verdict} |")
    print(f"| (f) bare ssh + pct exec + python -S reading the file's lines (no torch) | {f * 1000:.0f} ms | "
          f"{a / f:.1f}x | the floor: warm (c) is {c / f:.2f}x of it" + (f", (e) {e / f:.2f}x" if args.persist else "")
          + " (goal <= 1.0x) |")


if __name__ == "__main__":
    main()
