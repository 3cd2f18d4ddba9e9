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
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = "dflashctl.doctor/1"
# Smoke-test policies, in report order. The last three compile; the CUDA-graph ones need CUDA.
POLICIES = ("off", "default", "cudagraph-trees", "cudagraphs")
GRAPH_POLICIES = ("cudagraph-trees", "cudagraphs")
POLICY_TITLES = {
    "off": "threads: eager",
    "default": "threads: compile default",
    "cudagraph-trees": "threads: reduce-overhead, trees",
    "cudagraphs": "threads: reduce-overhead, no trees",
}
INJECTIONS = ("crash", "hang")
GIB = 1024**3
LOSS_RTOL = 2e-2  # bf16 replicas on identical data agree to ~1%; a broken replica is off by x10
STDERR_TAIL_LINES = 60
HANG_DUMP_GRACE_S = 1.0  # faulthandler writes from its signal handler: a second is plenty
# A smoke child's --smoke-timeout counts from the end of its imports (torch and the compiler take
# 3-20 s, more on a busy host, and are not what is tested); the imports themselves get this long.
START_BOUND_S = 600.0


class ArgumentError(ValueError):
    """A bad --gpus / --policies / --inject / --jobs value: exit 2 with one line."""


@dataclass
class Check:
    """One report row: what was checked, the outcome, the evidence for it, and what to do."""

    id: str
    check: str
    status: str
    result: str
    evidence: str = ""
    hint: str = ""


# --- environment checks ------------------------------------------------------------------------


def check_python() -> Check:
    """Interpreter version and path."""
    return Check("python", "python", "ok", platform.python_version(), sys.executable)


def check_torch(torch) -> list[Check]:
    """torch and triton versions, and the CUDA runtime torch was built against."""
    rows = [Check("torch", "torch", "ok", torch.__version__, f"CUDA runtime {torch.version.cuda or 'none (CPU build)'}")]
    try:
        import triton

        rows.append(Check("triton", "triton", "ok", triton.__version__))
    except ImportError:
        on_cuda = torch.version.cuda is not None
        rows.append(Check(
            "triton", "triton", "fail" if on_cuda else "n/a", "not installed",
            "import triton failed",
            "install the triton matching this torch (pip install torch pulls it in)" if on_cuda else "",
        ))
    return rows


def nvidia_smi() -> dict | None:
    """GPUs and versions as nvidia-smi reports them, or None when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = [exe, "--query-gpu=index,name,driver_version", "--format=csv,noheader"]
    try:
        listing = subprocess.run(query, capture_output=True, text=True, timeout=30)
        header = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"nvidia-smi: {exc}", "gpus": []}
    if listing.returncode != 0:
        lines = (listing.stderr or listing.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {listing.returncode}", "gpus": []}
    gpus = []
    for line in listing.stdout.strip().splitlines():
        index, name, driver = (f.strip() for f in line.split(","))
        gpus.append({"index": int(index), "name": name, "driver": driver})
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header.stdout)
    return {"gpus": gpus, "driver": gpus[0]["driver"] if gpus else None, "cuda": cuda.group(1) if cuda else None}


def missing_device_nodes(indices: list[int], dev: Path = Path("/dev")) -> list[str]:
    """The /dev/nvidia* nodes CUDA needs for these GPUs that do not exist here."""
    wanted = ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in indices)]
    return [f"/dev/{name}" for name in wanted if not (dev / name).exists()]


def check_gpus(smi: dict | None, torch_count: int, cuda_error: str | None, dev: Path = Path("/dev")) -> Check:
    """GPUs nvidia-smi sees against those torch sees; a gap usually means missing device passthrough."""
    if smi is None and torch_count == 0:
        return Check("gpus", "GPUs", "n/a", "no GPU", "nvidia-smi not found; torch.cuda.device_count() = 0")
    if smi is not None and smi.get("error"):
        return Check("gpus", "GPUs", "fail", "nvidia-smi fails", smi["error"],
                     "the driver is not usable in this container: check the host driver and the passthrough")
    if smi is None and not cuda_error:
        return Check("gpus", "GPUs", "warn", f"{torch_count} seen by torch", "nvidia-smi not found on PATH",
                     "install nvidia-smi (nvidia-utils) in the container to see driver and GPU details")
    smi_count = len(smi["gpus"]) if smi else 0
    evidence = f"nvidia-smi: {smi_count}, torch.cuda.device_count(): {torch_count}"
    if cuda_error:
        evidence += f"; CUDA init: {cuda_error}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        evidence += f"; CUDA_VISIBLE_DEVICES={visible}"
    if smi_count == torch_count and not cuda_error:
        names = sorted({g["name"] for g in smi["gpus"]}) if smi else []
        return Check("gpus", "GPUs", "ok", f"{torch_count} x {', '.join(names)}", evidence)
    absent = missing_device_nodes([g["index"] for g in smi["gpus"]] if smi else [], dev)
    if absent:
        evidence += f"; absent: {' '.join(absent)}"
        hint = ("pass the missing nodes into the container (LXC: `lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm "
                "none bind,optional,create=file` per node, and `lxc.cgroup2.devices.allow: c 195:* rwm` plus the "
                "uvm major from `ls -l /dev/nvidia-uvm`)")
    elif visible is not None and torch_count and not cuda_error:
        return Check("gpus", "GPUs", "warn", f"{torch_count} of {smi_count} visible to torch", evidence,
                     "CUDA_VISIBLE_DEVICES hides the others; unset it to use every GPU")
    else:
        hint = "torch cannot use GPUs nvidia-smi sees: check that torch's CUDA build fits the driver (row below)"
    return Check("gpus", "GPUs", "fail", f"{smi_count} seen by nvidia-smi, {torch_count} by torch", evidence, hint)


def check_driver(smi: dict | None, torch_cuda: str | None) -> Check:
    """Driver version and the CUDA version it supports against torch's CUDA runtime."""
    if not smi or not smi.get("gpus"):
        return Check("driver", "driver / CUDA", "n/a", "no NVIDIA driver", f"torch CUDA runtime: {torch_cuda or 'none'}")
    evidence = f"driver {smi['driver']} supports CUDA {smi['cuda']}; torch built for CUDA {torch_cuda or 'none'}"
    if torch_cuda is None:
        return Check("driver", "driver / CUDA", "fail", "torch is a CPU build", evidence,
                     "install a CUDA build of torch (e.g. the cu130 wheel index)")
    if smi["cuda"] and _version(torch_cuda)[:1] > _version(smi["cuda"])[:1]:
        return Check("driver", "driver / CUDA", "fail", f"driver too old for CUDA {torch_cuda}", evidence,
                     f"upgrade the host driver to one supporting CUDA {torch_cuda}, or use a torch built for CUDA {smi['cuda']}")
    return Check("driver", "driver / CUDA", "ok", f"driver {smi['driver']}, CUDA {torch_cuda}", evidence)


def check_capability(torch, indices: list[int]) -> Check:
    """Compute capability of the selected GPUs and whether this torch build has kernels for it."""
    if not indices:
        return Check("capability", "compute capability", "n/a", "no GPU")
    caps = {i: torch.cuda.get_device_capability(i) for i in indices}
    arch = torch.cuda.get_arch_list()
    shown = ", ".join(f"cuda:{i} sm_{a}{b}" for i, (a, b) in caps.items())
    evidence = f"torch arch list: {' '.join(arch)}"
    unsupported = [f"sm_{a}{b}" for a, b in set(caps.values()) if not _arch_supported((a, b), arch)]
    if unsupported:
        return Check("capability", "compute capability", "fail", shown, evidence,
                     f"this torch build has no kernels for {', '.join(unsupported)}: install one that does")
    if min(caps.values()) < (7, 0):
        return Check("capability", "compute capability", "warn", shown, evidence,
                     "Triton (torch.compile on GPU) needs sm_70 or newer: use compile off")
    return Check("capability", "compute capability", "ok", shown, evidence)


def _arch_supported(cap: tuple[int, int], arch: list[str]) -> bool:
    """True when the arch list has SASS for cap, or PTX (compute_XY) at or below it that the driver can JIT."""
    tag = f"{cap[0]}{cap[1]}"
    if any(a.startswith(f"sm_{tag}") for a in arch):
        return True
    ptx = [int(re.sub(r"\D", "", a)) for a in arch if a.startswith("compute_")]
    return any(p <= int(tag) for p in ptx)


def inductor_cache_dir(env_value: str | None) -> tuple[str, str]:
    """Where inductor writes its cache, and why there (the user's env var, or torch's default)."""
    if env_value:
        return os.path.abspath(env_value), "$TORCHINDUCTOR_CACHE_DIR"
    # Importing this module sets the variable as a side effect: put back what the user had.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return default_cache_dir(), "torch default"


def check_inductor_cache(path: str, source: str, min_free: float = 2 * GIB) -> Check:
    """The inductor cache directory: exists or can be made, writable, free space."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("inductor_cache", "inductor cache", "fail", "not writable", f"{path} ({source}): {exc.strerror}",
                     "export TORCHINDUCTOR_CACHE_DIR=<a writable dir with a few GiB free>")
    free = shutil.disk_usage(path).free
    evidence = f"{path} ({source}), {_gib(free)} free"
    if free < min_free:
        return Check("inductor_cache", "inductor cache", "warn", f"{_gib(free)} free", evidence,
                     "compiled kernels need room: free space or point TORCHINDUCTOR_CACHE_DIR elsewhere")
    if path.startswith(tempfile.gettempdir()):
        return Check("inductor_cache", "inductor cache", "ok", f"writable, {_gib(free)} free", evidence,
                     "under the temp dir it may be wiped on restart: set TORCHINDUCTOR_CACHE_DIR to keep compiles warm")
    return Check("inductor_cache", "inductor cache", "ok", f"writable, {_gib(free)} free", evidence)


def check_free(check_id: str, title: str, path: str, min_free: float, hint: str) -> Check:
    """Free space (or size, for tmpfs) of one mount point."""
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return Check(check_id, title, "fail", "missing", f"{path}: {exc.strerror}", hint)
    evidence = f"{path}: {_gib(usage.free)} free of {_gib(usage.total)}"
    status = "ok" if usage.free >= min_free else "warn"
    return Check(check_id, title, status, f"{_gib(usage.free)} free", evidence, hint if status != "ok" else "")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


# --- running one smoke test in its own process -----------------------------------------------


@dataclass
class ChildRun:
    """What a child process left behind: exit status, output, and whether it was killed for time."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    timeout: float  # the limit that ran out: the run's, or (not started) the bound on the imports
    started: bool = True  # the child got past its imports (run_child's `started` file appeared)


def run_child(argv: list[str], timeout: float, env: dict[str, str] | None = None,
              started: Path | None = None, start_bound: float = START_BOUND_S) -> ChildRun:
    """Run argv in a new process group; on timeout ask it for its thread stacks, then kill the group.
    With `started`, `timeout` counts from when the child creates that file (after its imports),
    which it must do within `start_bound` seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    is_started = started is None
    deadline = start + (timeout if is_started else start_bound)
    while True:
        try:
            # Short waits until the child has started, so the clock starts when it does.
            wait = deadline - time.monotonic() if is_started else min(0.2, deadline - time.monotonic())
            out, err = proc.communicate(timeout=max(wait, 0.0))
            return ChildRun(proc.returncode, out, err, False, time.monotonic() - start, timeout)
        except subprocess.TimeoutExpired:
            if not is_started and started.exists():
                is_started, deadline = True, time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                break
    # SIGUSR1 makes faulthandler (registered by the smoke child) print where every thread is.
    _signal_group(proc.pid, signal.SIGUSR1)
    try:
        out, err = proc.communicate(timeout=HANG_DUMP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return ChildRun(None, out, err, True, time.monotonic() - start, timeout if is_started else start_bound, is_started)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in | in )?(?P<func>\S*)')


def short_path(path: str) -> str:
    """A source path from its package on (`torch/_inductor/x.py`), so reports stay readable."""
    marker = re.search(r"(?:site|dist)-packages/(.+)$", path)
    if marker:
        return marker.group(1)
    if "/dflash_train/" in path:
        return "dflash_train/" + path.rsplit("/dflash_train/", 1)[1]
    return path


def _where(file: str, line: str | int, func: str = "") -> str:
    text = f"{short_path(file)}:{line}"
    return f"{text} in {func}" if func else text


Frame = tuple[str, str, str]  # file, line, function


def parse_thread_dump(text: str) -> list[tuple[bool, list[Frame]]]:
    """faulthandler's dump as (is the current thread, its frames innermost first)."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if re.match(r"^(Current thread|Thread) 0x[0-9a-f]+", line) or line.startswith("Stack (most recent call first)"):
            threads.append((line.startswith("Current thread"), []))
        elif threads:
            match = _FRAME.match(line)
            if match:
                threads[-1][1].append((match["file"], match["line"], match["func"]))
    return threads


def _in_stdlib(frame: Frame) -> bool:
    stdlib = sysconfig.get_paths()["stdlib"]
    return frame[0].startswith(stdlib) and not re.search(r"(site|dist)-packages", frame[0])


def _describe(frames: list[Frame]) -> str:
    """The innermost frame outside the stdlib (a wait in threading.py says little), and the innermost one."""
    own = next((f for f in frames if not _in_stdlib(f)), frames[0])
    text = _where(*own)
    return text if own is frames[0] else f"{text} (innermost: {_where(*frames[0])})"


def hang_location(stderr: str) -> str | None:
    """Where a hung child was stuck: every worker thread's position, else the main thread's."""
    threads = [(current, frames) for current, frames in parse_thread_dump(stderr) if frames]
    # The dump is written by the main thread, which only waits for the workers; one stuck worker
    # can hold a lock the others wait on, and which is which is the user's call: show them all.
    workers = [_describe(frames) for current, frames in threads if not current]
    chosen = workers or [_describe(frames) for _, frames in threads]
    return "; ".join(dict.fromkeys(chosen)) or None


def crash_location(stderr: str) -> str | None:
    """Where a fatal signal hit: the crashing ('Current') thread's innermost Python frame."""
    threads = [(current, frames) for current, frames in parse_thread_dump(stderr) if frames]
    threads.sort(key=lambda t: not t[0])
    return _describe(threads[0][1]) if threads else None


def traceback_location(stderr: str) -> tuple[str | None, str | None]:
    """The last exception line of a Python traceback on stderr and its innermost frame."""
    lines = stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return (lines[-1].strip() if lines else None), None
    block = lines[starts[-1]:]
    frames = [m for m in map(_FRAME.match, block) if m]
    message = next((ln for ln in block[1:] if ln and not ln.startswith(" ")), None)
    where = _where(frames[-1]["file"], frames[-1]["line"], frames[-1]["func"]) if frames else None
    return message, where


def classify(run: ChildRun) -> dict:
    """Outcome of a smoke child: ok, exception, segfault, signal, hang or error, with where it happened."""
    result = _last_json(run.stdout)
    base = {"seconds": round(run.seconds, 1), "returncode": run.returncode}
    if result is not None:  # it reported; what happened after is worth a note, not a new outcome
        if run.timed_out:
            result["after"] = "then did not exit; process group killed"
        elif run.returncode is not None and run.returncode < 0:
            result["after"] = f"then died of {signal.Signals(-run.returncode).name} while exiting"
        return {**base, **result}
    if run.timed_out:
        waited = (f"no result within {run.timeout:g} s of its start" if run.started else
                  f"not started (importing torch) within {run.timeout:g} s")
        return {**base, "outcome": "hang", "error": f"{waited}; process group killed",
                "where": hang_location(run.stderr)}
    if run.returncode is not None and run.returncode < 0:
        name = signal.Signals(-run.returncode).name
        outcome = "segfault" if -run.returncode in (signal.SIGSEGV, signal.SIGBUS) else "signal"
        return {**base, "outcome": outcome, "error": f"killed by {name}", "where": crash_location(run.stderr)}
    message, where = traceback_location(run.stderr)
    return {**base, "outcome": "exception" if where else "error",
            "error": message or f"exit code {run.returncode}, no result", "where": where}


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# --- the smoke child ---------------------------------------------------------------------------


def root_cause(exc: BaseException) -> BaseException:
    """The innermost `raise ... from` cause: WorkerError wraps the worker's own exception."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def exception_record(exc: BaseException) -> dict:
    """An exception as a smoke result: its first line, the file:line of its innermost frame, and
    the innermost trainer frame when the error is raised deeper (in torch)."""
    exc = root_cause(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = _where(frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
    ours = [f for f in frames if "/dflash_train/" in f.filename and not f.filename.endswith("/workers.py")]
    if where and ours and ours[-1] is not frames[-1]:
        where += f", from {_where(ours[-1].filename, ours[-1].lineno, ours[-1].name)}"
    return {"outcome": "exception", "error": first_line(exc), "where": where}


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def losses_agree(losses: list[float], rtol: float = LOSS_RTOL) -> bool:
    """True when every thread's final loss is within rtol of the first one's."""
    ref = losses[0]
    return all(abs(x - ref) <= rtol * max(abs(ref), 1e-12) for x in losses)


def smoke_policy(name: str, plan):
    """The run plan's CompilePolicy for a doctor policy; trees-on is the doctor's own, the trainer never picks it."""
    import dataclasses

    if name == "cudagraph-trees":
        # What mode="reduce-overhead" sets, with trees left at their default (on).
        options = {"triton.cudagraphs": True, "triton.cudagraph_trees": True}
        return dataclasses.replace(plan.policy, requested=name, options=options,
                                   reason="reduce-overhead with CUDAGraph Trees")
    return plan.policy


def smoke_plan(device_type: str, policy_name: str | None = None):
    """The trainer's tiny preset planned for this device, with random tokens (the step's cost does
    not depend on them); with a policy, `run.compile` as a user would set it for that policy, so
    that what follows from it (attention backend, compiled CE chunk, captures) matches: `off` is all eager."""
    from .config import load_config
    from .plan import resolve_run

    overrides = ["data.source=random", "data.num_train=32", "data.num_eval=8", f"run.device={device_type}"]
    if policy_name is not None:
        overrides.append(f"run.compile={'cudagraphs' if policy_name == 'cudagraph-trees' else policy_name}")
    return resolve_run(load_config(preset="tiny", overrides=overrides))


def default_compile_mode(device_type: str) -> str:
    """What `run.compile` resolves to when the user leaves it unset (the trainer's own rule)."""
    return smoke_plan(device_type).cfg.run.compile


def smoke_batches(cfg, count: int = 4) -> list:
    """A few fixed tiny batches from the trainer's own data pipeline."""
    from .data import BlockSampler, build_datasets

    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    return [sampler.batch(i) for i in range(count)]


def threaded_smoke(policy_name: str, devices: list[str], steps: int, inject: str | None) -> dict:
    """The trainer's tiny step in one worker thread per device under one policy, via run_threaded."""
    import torch

    from .replica import drafter_ops
    from .workers import ReplicaOps, ThreadedOptions, run_threaded

    plan = smoke_plan(devices[0].split(":")[0], policy_name)
    cfg = plan.cfg
    torch.set_num_threads(cfg.run.cpu_threads)  # as the trainer does (threads x OpenMP oversubscribe)
    ops, batches = drafter_ops(cfg), smoke_batches(cfg)
    policy = smoke_policy(policy_name, plan)
    wrapped = ReplicaOps(lambda device, seed, _: ops.build(device, seed, policy), ops.forward_backward,
                         ops.optimizer_step, ops.parameters, warm_up_step=ops.warm_up_step)
    # Injected faults use the trainer's own mechanism (run config `debug.fail_at` / `debug.hang_at`),
    # at "build": before anything is built, so the CI tests of these paths stay fast.
    fault = {"fail_at": "build"} if inject == "crash" else {"hang_at": "build"} if inject == "hang" else {}
    options = ThreadedOptions(policy=policy, warmup_steps=2, sync_every=steps, **fault)
    # Every worker gets the same micro-batch, so equal losses are a correctness check.
    result = run_threaded(wrapped, devices, lambda step, rank, world: batches[step % len(batches)], steps, options)
    return {
        "outcome": "ok",
        "ms_per_step": [round(ms, 2) for ms in result.step_ms],
        "compile_s": [round(s, 1) for s in result.warmup_s],
        "losses": result.losses,
        "losses_agree": losses_agree(result.losses),
    }


def smoke_main(args: argparse.Namespace) -> int:
    """Child entry: one smoke test; prints one JSON line (its result, or the exception's record)."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch  # noqa: F401 - imported before the started file: the parent's clock starts after it
    from . import replica, workers  # noqa: F401

    if args.started_file:
        Path(args.started_file).touch()
    try:
        record = threaded_smoke(args.policy, args.devices.split(","), args.steps, args.inject)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        print(json.dumps(exception_record(exc)), flush=True)
        traceback.print_exc()
        return 1
    print(json.dumps(record), flush=True)
    return 0


# --- the report --------------------------------------------------------------------------------


def parse_inject(spec: str | None) -> dict[str, str]:
    """`crash:default,hang:off` -> {policy: fault}; unknown faults or policies raise ArgumentError."""
    faults: dict[str, str] = {}
    for item in filter(None, (spec or "").split(",")):
        fault, _, policy = item.partition(":")
        if fault not in INJECTIONS or policy not in POLICIES:
            raise ArgumentError(f"--inject takes FAULT:POLICY with FAULT in {INJECTIONS} and POLICY in {POLICIES}, got {item!r}")
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
    argv = [sys.executable, "-X", "faulthandler", "-m", "dflash_train.doctor", "smoke",
            "--policy", policy, "--devices", ",".join(devices), "--steps", str(steps)]
    if inject:
        argv += ["--inject", inject]
    with tempfile.TemporaryDirectory(prefix="dflash-smoke-") as tmp:
        started = Path(tmp) / "started"
        run = run_child(argv + ["--started-file", str(started)], timeout, child_env(), started)
    record = {"policy": policy, "devices": devices, "injected": inject, **classify(run)}
    if record["outcome"] != "ok" or "after" in record:
        # The whole stack (tracebacks, faulthandler dumps) for --json readers and bug reports.
        record["stderr_tail"] = run.stderr.splitlines()[-STDERR_TAIL_LINES:]
    return record


def smoke_check(policy: str, detail: dict, trainer_policies: set[str]) -> Check:
    """A smoke result as a report row; a failure of a policy the trainer may pick is a fail."""
    title = POLICY_TITLES[policy]
    outcome = detail["outcome"]
    if outcome in ("n/a", "skipped"):
        return Check(f"smoke:{policy}", title, outcome, detail["error"])
    if outcome == "ok":
        ms = " / ".join(f"{m:.1f}" for m in detail["ms_per_step"])
        warm = " / ".join(map(str, detail["compile_s"]))
        if "compile_pass_s" in detail:
            warm = f"compile pass {detail['compile_pass_s']} s, then compile+warm-up from the cache {warm}"
        else:
            warm = f"compile+warm-up {warm}"
        evidence = (f"{' + '.join(detail['devices'])}; {warm} s; "
                    f"final losses {' / '.join(f'{x:.4f}' for x in detail['losses'])}")
        if not detail["losses_agree"]:
            return Check(f"smoke:{policy}", title, "fail", f"losses disagree ({ms} ms/step)", evidence,
                         "one replica trains on different numbers: do not train with this policy")
        return Check(f"smoke:{policy}", title, "ok", f"ok, {ms} ms/step, losses agree", evidence)
    where = f" at {detail['where']}" if detail.get("where") else ""
    after = f"; {detail['after']}" if detail.get("after") else ""
    evidence = f"{detail['error']}{where}{after}"
    if detail.get("found_in"):
        evidence += f" ({detail['found_in']})"
    if detail.get("injected"):
        evidence += f" [injected {detail['injected']}]"
    expected = policy not in trainer_policies
    hint = _failure_hint(policy, outcome, expected)
    return Check(f"smoke:{policy}", title, "warn" if expected else "fail", outcome, evidence, hint)


def _failure_hint(policy: str, outcome: str, expected: bool) -> str:
    if expected:
        return ("CUDAGraph Trees are not thread-safe before torch 2.13; the trainer never uses them in threads "
                "(its cudagraphs policy turns trees off)")
    if outcome == "hang":
        return f"compile: {policy} hangs in threads here: use another policy (stacks: --json, stderr_tail)"
    return f"compile: {policy} fails in threads here: set run.compile to a policy whose row is ok (traceback: --json)"


def trainer_policies(device_type: str) -> set[str]:
    """The doctor policies the trainer can end up with on this device (over every `run.compile` value)."""
    from .plan import COMPILE_MODES, choose_compile_policy

    return {choose_compile_policy(mode, device_type).effective for mode in COMPILE_MODES}


def launcher_verdict(gpus: int) -> str:
    """What `run.launcher: auto` picks on a box with this many GPUs, for each width class of
    plan.THREADS_KEEP_UP (the model is the user's, so every class is named)."""
    from .plan import THREADS_KEEP_UP, launcher_decision

    devices = [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    picks = []
    for i, (width, _) in enumerate(THREADS_KEEP_UP):
        which = launcher_decision("auto", devices, width)[0]
        upper = THREADS_KEEP_UP[i - 1][0] if i else None
        widths = f">= {width}" if upper is None else f"< {upper}" if width == 0 else f"{width}-{upper - 1}"
        picks.append(f"{which} for target hidden {widths}")
    return f"launcher (run.launcher auto, {gpus} GPU(s)): {', '.join(picks)}"


def verdict_check(device_type: str, mode: str, smoke: dict[str, dict], gpus: int) -> Check:
    """Which policy and launcher the trainer uses here for `run.compile` resolved to mode, why, and
    whether the smoke test backs the policy."""
    from .plan import choose_compile_policy

    policy = choose_compile_policy(mode, device_type)
    result = f"trainer uses {policy.effective} (run.compile unset -> {mode}); {launcher_verdict(gpus)}"
    evidence = policy.reason
    tested = smoke.get(policy.effective, {})
    faster = _fastest_ok(smoke)
    if tested.get("outcome") in (None, "skipped", "n/a"):
        return Check("verdict", "verdict", "ok", result, f"{evidence}; not smoke-tested ({tested.get('error', 'not run')})")
    if tested["outcome"] != "ok" or not tested["losses_agree"]:
        hint = f"set run.compile: {faster} (its smoke test passed)" if faster else "no policy passed: see the rows above"
        return Check("verdict", "verdict", "fail", result + f": its smoke test gave {tested['outcome']}", evidence, hint)
    hint = ""
    if faster and faster != policy.effective:
        gain = _mean(smoke[policy.effective]["ms_per_step"]) / _mean(smoke[faster]["ms_per_step"])
        if gain > 1.2:  # below this the difference is noise on a tiny step
            hint = f"run.compile: {faster} was {gain:.1f}x faster here"
    return Check("verdict", "verdict", "ok", result, evidence + "; smoke test ok", hint)


def _fastest_ok(smoke: dict[str, dict]) -> str | None:
    # Trees-on is excluded: the trainer never runs it in threads, whatever it measured here.
    ok = {p: d for p, d in smoke.items() if d["outcome"] == "ok" and d["losses_agree"] and p != "cudagraph-trees"}
    return min(ok, key=lambda p: _mean(ok[p]["ms_per_step"])) if ok else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def environment_checks(torch, gpus: list[int], smi: dict | None, count: int, cuda_error: str | None,
                       cache_env: str | None) -> list[Check]:
    """Every check that runs in this process: versions, GPUs, driver, caches, scratch space."""
    cache, source = inductor_cache_dir(cache_env)
    return [
        check_python(),
        *check_torch(torch),
        check_gpus(smi, count, cuda_error),
        check_driver(smi, torch.version.cuda),
        check_capability(torch, gpus),
        check_inductor_cache(cache, source),
        check_free("tmp", "/tmp", tempfile.gettempdir(), 2 * GIB,
                   "compilers write temporaries here: free space or set TMPDIR"),
        check_free("shm", "/dev/shm", "/dev/shm", 1 * GIB,
                   "data-loader workers and NCCL share memory here: raise the container's shm size "
                   "(docker --shm-size=16g; LXC: a larger tmpfs on /dev/shm)"),
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


def smoke_tests(args: argparse.Namespace, devices: list[str], faults: dict[str, str],
                jobs: int | None) -> dict[str, dict]:
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
        results.update(run_smokes(runnable, devices, steps, args.smoke_timeout, faults,
                                  jobs or default_jobs(len(runnable), usable_cpus())))
    return {policy: results[policy] for policy in POLICIES}


def run_smokes(policies: list[str], devices: list[str], steps: int, timeout: float, faults: dict[str, str],
               jobs: int) -> dict[str, dict]:
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
    checks = environment_checks(torch, gpus, smi, count, cuda_error, cache_env)
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
    rep.add_argument("--gpus", help="GPU indices, e.g. 0,1 (default: every visible GPU)")
    rep.add_argument("--policies", help=f"comma list of smoke policies (default: all of {','.join(POLICIES)})")
    rep.add_argument("--smoke-timeout", type=float, default=120.0, help="seconds per smoke test before it is a hang")
    rep.add_argument("--steps", type=int, default=0, help="timed steps per smoke test (default: 30 on GPU, 3 on CPU)")
    rep.add_argument("--jobs", help="compile-pass children at once (default: one per 4 CPUs, at most one per "
                     "policy; 1: no compile pass)")
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
    sys.exit(main())
