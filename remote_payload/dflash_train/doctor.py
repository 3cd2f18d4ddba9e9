"""Container side of `dflashctl doctor`: environment checks and threaded-compile smoke tests.

    python -m dflash_train.doctor report [--quick] [--gpus 0,1] [--policies off,default] [--jobs N]
                                         [--smoke-timeout S] [--steps N] [--inject crash:default,hang:off]
        prints one JSON report (see `report`) on stdout, progress lines on stderr.
    python -m dflash_train.doctor smoke --policy P --devices cuda:0,cuda:1 [--steps N] [--inject crash|hang]
        one smoke test; `report` runs each in its own process group under a time limit, so a crash,
        segfault or hang in the compiler is a finding rather than the end of the report. With
        --jobs above 1, a compile pass first runs every policy for one step, --jobs at once (their
        compiles overlap and fill the inductor cache); the timed pass then runs one at a time.

Statuses: ok | warn | fail | n/a | skipped. `report` exits 0 unless a check has status fail.
This module is the program; the rows are doctor_checks.py's, the child process doctor_child.py's,
the smoke test itself doctor_smoke.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from .doctor_checks import (
    GIB,
    GRAPH_POLICIES,
    POLICIES,
    Check,
    check_capability,
    check_driver,
    check_free,
    check_gpus,
    check_inductor_cache,
    check_python,
    check_torch,
    inductor_cache_dir,
    nvidia_smi,
    smoke_check,
    trainer_policies,
    verdict_check,
)
from .doctor_child import ChildRun, classify, run_child
from .doctor_smoke import default_compile_mode, first_line, smoke_main

SCHEMA = "dflashctl.doctor/1"
INJECTIONS = ("crash", "hang")
STDERR_TAIL_LINES = 60


class ArgumentError(ValueError):
    """A bad --gpus / --policies / --inject / --jobs value: exit 2 with one line."""


# --- the report --------------------------------------------------------------------------------


def parse_inject(spec: str | None) -> dict[str, str]:
    """`crash:default,hang:off` -> {policy: fault}; unknown faults or policies raise ArgumentError."""
    faults: dict[str, str] = {}
    for item in filter(None, (spec or "").split(",")):
        fault, _, policy = item.partition(":")
        if fault not in INJECTIONS or policy not in POLICIES:
            raise ArgumentError(
                f"--inject takes FAULT:POLICY with FAULT in {INJECTIONS} and POLICY in {POLICIES}, got {item!r}"
            )
        faults[policy] = fault
    return faults


def parse_jobs(spec: str | None) -> int | None:
    """`--jobs N` -> N (at least 1); None when not given."""
    if spec is None:
        return None
    if not re.fullmatch(r"\d+", spec) or int(spec) < 1:
        raise ArgumentError(f"--jobs takes how many smoke tests run at once, 1 or more, got {spec!r}")
    return int(spec)


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may really use: its affinity mask (an LXC `cores:` cpuset) capped by a
    cgroup v2 quota (`cpu.max`, e.g. docker --cpus); os.cpu_count() reports the host's."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, -(-int(quota) // int(period))))  # a partial CPU still counts as one


def default_jobs(count: int, cpus: int | None) -> int:
    """Compile-pass children at once when --jobs is not given: one per 4 CPUs, so that CPU
    contention on a small container does not push a slow compile past --smoke-timeout into a
    false hang (1: no compile pass, the smoke tests run one after another)."""
    return max(1, min(count, (cpus or 1) // 4))


def parse_gpus(spec: str | None, count: int) -> list[int]:
    """`0,1` -> [0, 1] checked against the GPUs torch sees; None -> every visible GPU."""
    if not spec:
        return list(range(count))
    if not re.fullmatch(r"\d+(,\d+)*", spec):
        raise ArgumentError(f"--gpus takes indices like 0,1, got {spec!r}")
    indices = [int(g) for g in spec.split(",")]
    bad = [g for g in indices if not 0 <= g < count]
    if bad:
        raise ArgumentError(f"--gpus {spec}: torch sees {count} GPU(s), no index {bad[0]}")
    return indices


def smoke_devices(gpus: list[int]) -> list[str]:
    """The worker devices the trainer would use here, capped at two: two GPUs (threads across
    devices), one GPU (one worker thread: what a one-GPU host runs), or the CPU twice (the
    threaded path on a host without a GPU)."""
    if len(gpus) >= 2:
        return [f"cuda:{gpus[0]}", f"cuda:{gpus[1]}"]
    if gpus:
        return [f"cuda:{gpus[0]}"]
    return ["cpu", "cpu"]


def child_env() -> dict[str, str]:
    """This environment, with the payload importable from any working directory."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_smoke(policy: str, devices: list[str], steps: int, timeout: float, inject: str | None) -> dict:
    """One smoke test in its own process group, classified."""
    argv = [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "dflash_train.doctor",
        "smoke",
        "--policy",
        policy,
        "--devices",
        ",".join(devices),
        "--steps",
        str(steps),
    ]
    if inject:
        argv += ["--inject", inject]
    with tempfile.TemporaryDirectory(prefix="dflash-smoke-") as tmp:
        started = Path(tmp) / "started"
        run: ChildRun = run_child(argv + ["--started-file", str(started)], timeout, child_env(), started)
    record = {"policy": policy, "devices": devices, "injected": inject, **classify(run)}
    if record["outcome"] != "ok" or "after" in record:
        # The whole stack (tracebacks, faulthandler dumps) for --json readers and bug reports.
        record["stderr_tail"] = run.stderr.splitlines()[-STDERR_TAIL_LINES:]
    return record


def environment_checks(
    torch,
    gpus: list[int],
    smi: dict | None,
    count: int,
    cuda_error: str | None,
    cache_env: str | None,
    run_cache: str | None = None,
) -> list[Check]:
    """Every check that runs in this process: versions, GPUs, driver, caches, scratch space."""
    cache, source = inductor_cache_dir(cache_env, run_cache)
    return [
        check_python(),
        *check_torch(torch),
        check_gpus(smi, count, cuda_error),
        check_driver(smi, torch.version.cuda),
        check_capability(torch, gpus),
        check_inductor_cache(cache, source),
        check_free(
            "tmp", "/tmp", tempfile.gettempdir(), 2 * GIB, "compilers write temporaries here: free space or set TMPDIR"
        ),
        check_free(
            "shm",
            "/dev/shm",
            "/dev/shm",
            1 * GIB,
            "data-loader workers and NCCL share memory here: raise the container's shm size "
            "(docker --shm-size=16g; LXC: a larger tmpfs on /dev/shm)",
        ),
    ]


def cuda_devices(torch) -> tuple[int, str | None]:
    """How many GPUs torch sees, and the error if CUDA cannot start."""
    try:
        count = torch.cuda.device_count()
        if count:
            torch.cuda.init()
        return count, None
    except Exception as exc:  # noqa: BLE001 - reported as evidence on the GPU row
        return 0, first_line(exc)


def smoke_tests(
    args: argparse.Namespace, devices: list[str], faults: dict[str, str], jobs: int | None
) -> dict[str, dict]:
    """Each policy's smoke result (or why it did not run), in report order; up to `jobs` at once."""
    wanted = args.policies.split(",") if args.policies else list(POLICIES)
    unknown = sorted(set(wanted) - set(POLICIES))
    if unknown:
        raise ArgumentError(f"--policies: unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    results, runnable = {}, []
    for policy in POLICIES:
        if policy in GRAPH_POLICIES and devices[0] == "cpu":
            results[policy] = {"policy": policy, "outcome": "n/a", "error": "CUDA graphs need a GPU"}
        elif args.quick or policy not in wanted:
            why = "--quick" if args.quick else "not in --policies"
            results[policy] = {"policy": policy, "outcome": "skipped", "error": why}
        else:
            runnable.append(policy)
    if runnable:
        steps = args.steps or _default_steps(devices)
        results.update(
            run_smokes(
                runnable, devices, steps, args.smoke_timeout, faults, jobs or default_jobs(len(runnable), usable_cpus())
            )
        )
    return {policy: results[policy] for policy in POLICIES}


def run_smokes(
    policies: list[str], devices: list[str], steps: int, timeout: float, faults: dict[str, str], jobs: int
) -> dict[str, dict]:
    """Each policy's smoke test. With jobs > 1, a compile pass first: every policy for one step,
    `jobs` at once (separate processes compile in parallel, and fill the inductor cache on disk);
    a crash or hang there is that policy's finding. Then the timed pass, one at a time, so that
    no compile shares the CPU with a timed step; it reads the compiled code from the cache."""

    def one(policy: str, n_steps: int, label: str = "") -> dict:
        _progress(f"smoke {policy}{label} on {'+'.join(devices)} ...")
        record = run_smoke(policy, devices, n_steps, timeout, faults.get(policy))
        _progress(f"smoke {policy}{label}: {record['outcome']} ({record['seconds']} s)")
        return record

    results: dict[str, dict] = {}
    compiled: dict[str, float] = {}  # policy -> seconds of its compile-pass child
    if jobs > 1 and len(policies) > 1:
        pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="doctor-smoke")
        try:
            futures = {policy: pool.submit(one, policy, 1, " (compile pass)") for policy in policies}
            for policy, future in futures.items():
                record = future.result()
                if record["outcome"] == "ok":
                    compiled[policy] = record["seconds"]
                else:
                    results[policy] = {**record, "found_in": "compile pass"}
        finally:
            pool.shutdown(cancel_futures=True)  # Ctrl-C: start no more children
    for policy in policies:
        if policy not in results:
            record = one(policy, steps)
            results[policy] = {**record, "compile_pass_s": compiled[policy]} if policy in compiled else record
    return results


def _default_steps(devices: list[str]) -> int:
    # Enough steps on a GPU for a stable ms/step; on CPU only enough to exercise the step.
    return 3 if devices[0] == "cpu" else 30


_PROGRESS_LOCK = threading.Lock()


def _progress(message: str) -> None:
    # One write per line under a lock: smoke threads report concurrently.
    with _PROGRESS_LOCK:
        sys.stderr.write(f"doctor: {message}\n")
        sys.stderr.flush()


def report(args: argparse.Namespace) -> dict:
    """Run every check and smoke test; the JSON document `dflashctl doctor` renders."""
    cache_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # before torch's imports can set it
    faults = parse_inject(args.inject)
    jobs = parse_jobs(args.jobs)
    import torch

    started = time.monotonic()
    smi = nvidia_smi()
    count, cuda_error = cuda_devices(torch)
    gpus = parse_gpus(args.gpus, count)
    devices = smoke_devices(gpus)
    checks = environment_checks(torch, gpus, smi, count, cuda_error, cache_env, args.compile_cache_dir)
    smoke = smoke_tests(args, devices, faults, jobs)
    device_type = devices[0].split(":")[0]
    allowed = trainer_policies(device_type)
    checks += [smoke_check(p, d, allowed) for p, d in smoke.items()]
    checks.append(verdict_check(device_type, default_compile_mode(device_type), smoke, len(gpus)))
    return {
        "schema": SCHEMA,
        "ok": all(c.status != "fail" for c in checks),
        "torch": torch.__version__,
        "devices": devices,
        "gpus": gpus,
        "checks": [asdict(c) for c in checks],
        "smoke": list(smoke.values()),
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    """The `report` and `smoke` subcommands."""
    parser = argparse.ArgumentParser(prog="python -m dflash_train.doctor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="all checks; JSON on stdout")
    rep.add_argument("--quick", action="store_true", help="skip the smoke tests")
    rep.add_argument("--compile-cache-dir", help="the runs' run.compile_cache_dir (dflashctl: <workdir>/cache/compile)")
    rep.add_argument("--gpus", help="GPU indices, e.g. 0,1 (default: every visible GPU)")
    rep.add_argument("--policies", help=f"comma list of smoke policies (default: all of {','.join(POLICIES)})")
    rep.add_argument("--smoke-timeout", type=float, default=120.0, help="seconds per smoke test before it is a hang")
    rep.add_argument("--steps", type=int, default=0, help="timed steps per smoke test (default: 30 on GPU, 3 on CPU)")
    rep.add_argument(
        "--jobs",
        help="compile-pass children at once (default: one per 4 CPUs, at most one per policy; 1: no compile pass)",
    )
    rep.add_argument("--inject", help="test hook: FAULT:POLICY[,...], FAULT crash or hang")
    smoke = sub.add_parser("smoke", help="one smoke test (run by report in its own process)")
    smoke.add_argument("--policy", choices=POLICIES, required=True)
    smoke.add_argument("--devices", required=True, help="comma list, e.g. cuda:0,cuda:1 or cpu,cpu")
    smoke.add_argument("--steps", type=int, default=3)
    smoke.add_argument("--inject", choices=INJECTIONS)
    smoke.add_argument("--started-file", help="created once the imports are done (the parent's clock starts then)")
    return parser


EXIT_MISSING = 4  # a module the report needs is not installed (the trainer's own code for it)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `report` prints the JSON report (exit 0, or 1 when a check failed; 2 bad
    arguments; 4 torch missing); `smoke` runs one test."""
    args = build_parser().parse_args(argv)
    if args.command == "smoke":
        return smoke_main(args)
    try:
        doc = report(args)
    except ArgumentError as exc:  # one line for the client, which exits 2 with it (not a progress line)
        print(f"doctor usage error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # torch (or what it needs) is not installed: the client's exit 4
        print(f"doctor missing module: {exc.name or exc}", file=sys.stderr)
        return EXIT_MISSING
    print(json.dumps(doc), flush=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    from .fast_exit import exit_now

    exit_now(main())
