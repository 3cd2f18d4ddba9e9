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
The runs are paired: each round runs every variant once, in rotating order, so all see the same
load; the table has the median wall time, the median client CPU time (user + system of the
process and the children it waited for: not sshd, the container side nor the mux) and the load
average over the rounds (os.getloadavg). dflashctl's modules are byte-compiled first (as pip does).
It checks that all of them print the same lines, then prints a markdown table with the ratios.
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import resource
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
FLOOR_GOAL = 0.8  # warm inspect with the default persist, against the bare read (f)


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
    script = (
        f"lines = open({path!r}).read().splitlines()\n"
        f"for i in range({first}, {last + 1}): print(f'{{i}}: {{lines[i - 1]}}')"
    )
    remote = shlex.join([str(host.pct_path), "exec", str(SHIM_VMID), "--", sys.executable, "-S", "-c", script])
    return one_liner(host, first, last)[:-1] + [remote]


def cli_argv(spec: str) -> list[str]:
    """The installed console script next to this interpreter (what an activated venv runs)."""
    script = Path(sys.executable).parent / "dflashctl"
    return [str(script), "inspect", "compile_fx", "--lines", spec]


def timed(
    argv: list[str],
    env: dict[str, str],  # type: ignore[no-untyped-def]
    before=None,
) -> tuple[float, float, str]:
    """Wall time, client CPU time and stdout of one run (before() runs first, untimed)."""
    if before:
        before()
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(argv)[:200]}\n{proc.stderr[-2000:]}")
    return elapsed, _children_cpu() - cpu, proc.stdout


def _children_cpu() -> float:
    """User + system seconds of the children waited for so far."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def measure_paired(variants: dict, runs: int) -> tuple[dict, dict, dict, list[float]]:  # type: ignore[type-arg]
    """Run every variant (name -> (argv, env, before)) once per round, in rotating order; the
    median wall and CPU time per variant, its last output, and the 1-minute load of each round."""
    names = list(variants)
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    outs: dict[str, str] = {}
    load = []
    for i in range(runs):
        load.append(os.getloadavg()[0])
        for name in names[i % len(names) :] + names[: i % len(names)]:
            argv, env, before = variants[name]
            wall, cpu, outs[name] = timed(argv, env, before)
            walls[name].append(wall)
            cpus[name].append(cpu)
    med = lambda d: {n: statistics.median(v) for n, v in d.items()}  # noqa: E731
    return med(walls), med(cpus), outs, load


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
    parser.add_argument(
        "--persist",
        type=int,
        default=60,
        help="also time the host with `persist: N` (a mux; 60 is hosts.yaml's default; 0: not)",
    )
    args = parser.parse_args()
    compileall.compile_dir(str(ROOT / "dflashctl"), quiet=1)
    first, last = (int(x) for x in args.lines.split(":"))
    with tempfile.TemporaryDirectory(prefix="inspect-bench-") as tmp:
        host = SshdHost(Path(tmp) / "sshd", "127.0.0.1").start()
        try:
            cache = Path(tmp) / "cache"
            env = {**host.env, "XDG_CACHE_HOME": str(cache)}
            clear = lambda: shutil.rmtree(cache, ignore_errors=True)  # noqa: E731
            timed(one_liner(host, first, last), env)  # warm the page cache for torch's files
            # (b)/(d) share the client cache directory with (c)/(e): each cold run empties it,
            # and each warm run first fills it (untimed), so the rotation cannot mix them up.
            fill = lambda e: lambda: timed(cli_argv(args.lines), e)  # noqa: E731
            variants = {
                "a": (one_liner(host, first, last), env, None),
                "b": (cli_argv(args.lines), env, clear),
                "c": (cli_argv(args.lines), env, fill(env)),
                "f": (bare_read(host, compile_fx_path(), first, last), env, None),
            }
            penv = env
            if args.persist:
                runtime = Path(tmp) / "rt"
                runtime.mkdir(mode=0o700)
                penv = {**env, "XDG_RUNTIME_DIR": str(runtime)}
                host.write_inventory(extra_hosts={"muxed": host.host_entry(SHIM_VMID, persist=args.persist)})
                muxed = cli_argv(args.lines) + ["--host", "muxed"]
                timed(muxed, penv)  # starts the mux
                variants.update(d=(muxed, penv, clear), e=(muxed, penv, lambda: timed(muxed, penv)))
            try:
                wall, cpu, outs, load = measure_paired(variants, args.runs)
            finally:
                if args.persist:
                    subprocess.run([*cli_argv("1")[:1], "hosts", "disconnect", "--all"], env=penv, capture_output=True)
        finally:
            host.stop()
    if len(set(outs.values())) != 1:
        raise SystemExit("outputs differ between the one-liner and dflashctl inspect")
    a, f = wall["a"], wall["f"]
    lines = len(outs["a"].splitlines())
    print(f"{date.today()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch_version()}, "
          f"median of {args.runs} paired rounds, lines {args.lines} ({lines} lines, identical output), "
          f"load average (1 min) over the rounds {min(load):.1f}-{max(load):.1f} (median "
          f"{statistics.median(load):.1f})\n")  # fmt: skip
    print("| run | median wall time | client CPU | speed-up vs (a) | against the floor (f) | goal |")
    print("|---|---|---|---|---|---|")
    print(
        f"| (a) ssh + pct exec + bash -lc + python importing torch | {a * 1000:.0f} ms | {cpu['a'] * 1000:.0f} ms "
        f"| 1.0x | {a / f:.2f}x | |"
    )
    rows = [
        ("b", "(b) dflashctl inspect, cold cache, persist: 0", "cold"),
        ("c", "(c) dflashctl inspect, warm cache, persist: 0", "warm"),
    ]
    if args.persist:
        rows += [
            ("d", f"(d) dflashctl inspect, cold cache, persist: {args.persist}", "cold"),
            ("e", f"(e) dflashctl inspect, warm cache, persist: {args.persist}", "warm"),
        ]
    for key, label, goal in rows:
        ratio, floor = a / wall[key], wall[key] / f
        verdict = "met" if ratio >= GOALS[goal] else "MISSED"
        goals = f">= {GOALS[goal]:.0f}x {verdict}"
        if key == "e":
            goals += f"; <= {FLOOR_GOAL}x the floor {'met' if floor <= FLOOR_GOAL else 'MISSED'}"
        print(
            f"| {label} | {wall[key] * 1000:.0f} ms | {cpu[key] * 1000:.0f} ms | {ratio:.1f}x | {floor:.2f}x "
            f"| {goals} |"
        )
    print(
        f"| (f) bare ssh + pct exec + python -S reading the file's lines (no torch) | {f * 1000:.0f} ms | "
        f"{cpu['f'] * 1000:.0f} ms | {a / f:.1f}x | 1.00x | the floor |"
    )


if __name__ == "__main__":
    main()
