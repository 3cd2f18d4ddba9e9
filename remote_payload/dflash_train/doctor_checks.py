"""The rows of `dflashctl doctor`'s report: the environment checks of this container (versions,
GPUs, driver, caches, scratch space) and the rows made from the smoke tests (each policy's, and
the verdict: what the trainer uses here). The program is doctor.py."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Smoke-test policies, in report order. The last three compile; the CUDA-graph ones need CUDA.
# Smoke-test policies, in report order. The last three compile; the CUDA-graph ones need CUDA.
POLICIES = ("off", "default", "cudagraph-trees", "cudagraphs")
GRAPH_POLICIES = ("cudagraph-trees", "cudagraphs")
POLICY_TITLES = {
    "off": "threads: eager",
    "default": "threads: compile default",
    "cudagraph-trees": "threads: reduce-overhead, trees",
    "cudagraphs": "threads: reduce-overhead, no trees",
}
GIB = 1024**3


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
    rows = [
        Check("torch", "torch", "ok", torch.__version__, f"CUDA runtime {torch.version.cuda or 'none (CPU build)'}")
    ]
    try:
        import triton

        rows.append(Check("triton", "triton", "ok", triton.__version__))
    except ImportError:
        on_cuda = torch.version.cuda is not None
        rows.append(
            Check(
                "triton",
                "triton",
                "fail" if on_cuda else "n/a",
                "not installed",
                "import triton failed",
                "install the triton matching this torch (pip install torch pulls it in)" if on_cuda else "",
            )
        )
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
        return Check(
            "gpus",
            "GPUs",
            "fail",
            "nvidia-smi fails",
            smi["error"],
            "the driver is not usable in this container: check the host driver and the passthrough",
        )
    if smi is None and not cuda_error:
        return Check(
            "gpus",
            "GPUs",
            "warn",
            f"{torch_count} seen by torch",
            "nvidia-smi not found on PATH",
            "install nvidia-smi (nvidia-utils) in the container to see driver and GPU details",
        )
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
        hint = (
            "pass the missing nodes into the container (LXC: `lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm "
            "none bind,optional,create=file` per node, and `lxc.cgroup2.devices.allow: c 195:* rwm` plus the "
            "uvm major from `ls -l /dev/nvidia-uvm`)"
        )
    elif visible is not None and torch_count and not cuda_error:
        return Check(
            "gpus",
            "GPUs",
            "warn",
            f"{torch_count} of {smi_count} visible to torch",
            evidence,
            "CUDA_VISIBLE_DEVICES hides the others; unset it to use every GPU",
        )
    else:
        hint = "torch cannot use GPUs nvidia-smi sees: check that torch's CUDA build fits the driver (row below)"
    return Check("gpus", "GPUs", "fail", f"{smi_count} seen by nvidia-smi, {torch_count} by torch", evidence, hint)


def check_driver(smi: dict | None, torch_cuda: str | None) -> Check:
    """Driver version and the CUDA version it supports against torch's CUDA runtime."""
    if not smi or not smi.get("gpus"):
        return Check(
            "driver", "driver / CUDA", "n/a", "no NVIDIA driver", f"torch CUDA runtime: {torch_cuda or 'none'}"
        )
    evidence = f"driver {smi['driver']} supports CUDA {smi['cuda']}; torch built for CUDA {torch_cuda or 'none'}"
    if torch_cuda is None:
        return Check(
            "driver",
            "driver / CUDA",
            "fail",
            "torch is a CPU build",
            evidence,
            "install a CUDA build of torch (e.g. the cu130 wheel index)",
        )
    if smi["cuda"] and _version(torch_cuda)[:1] > _version(smi["cuda"])[:1]:
        return Check(
            "driver",
            "driver / CUDA",
            "fail",
            f"driver too old for CUDA {torch_cuda}",
            evidence,
            f"upgrade the host driver to one supporting CUDA {torch_cuda}, or use a torch built for CUDA {smi['cuda']}",
        )
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
        return Check(
            "capability",
            "compute capability",
            "fail",
            shown,
            evidence,
            f"this torch build has no kernels for {', '.join(unsupported)}: install one that does",
        )
    if min(caps.values()) < (7, 0):
        return Check(
            "capability",
            "compute capability",
            "warn",
            shown,
            evidence,
            "Triton (torch.compile on GPU) needs sm_70 or newer: use compile off",
        )
    return Check("capability", "compute capability", "ok", shown, evidence)


def _arch_supported(cap: tuple[int, int], arch: list[str]) -> bool:
    """True when the arch list has SASS for cap, or PTX (compute_XY) at or below it that the driver can JIT."""
    tag = f"{cap[0]}{cap[1]}"
    if any(a.startswith(f"sm_{tag}") for a in arch):
        return True
    ptx = [int(re.sub(r"\D", "", a)) for a in arch if a.startswith("compute_")]
    return any(p <= int(tag) for p in ptx)


RUN_CACHE = "run.compile_cache_dir of dflashctl's runs"


def inductor_cache_dir(env_value: str | None, run_cache: str | None = None) -> tuple[str, str]:
    """Where a run's inductor cache is, and why there: the user's env var (it wins in the trainer
    too), the run.compile_cache_dir that dflashctl gives its runs, or torch's default."""
    if env_value:
        return os.path.abspath(env_value), "$TORCHINDUCTOR_CACHE_DIR"
    if run_cache:
        return os.path.abspath(os.path.expanduser(run_cache)), RUN_CACHE
    return _torch_default_cache_dir(), "torch default"


def _torch_default_cache_dir() -> str:
    """torch's own rule (torch._inductor.runtime.cache_dir_utils.default_cache_dir), read from its
    file: importing it by name runs torch._inductor's __init__, which imports Dynamo (~1.5 s of
    CPU, and sets TORCHINDUCTOR_CACHE_DIR as a side effect)."""
    import importlib.util

    import torch

    path = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
    spec = importlib.util.spec_from_file_location("_dflash_doctor_cache_dir_utils", path)
    if spec is None or spec.loader is None or not path.is_file():  # another layout: the import, its side effect undone
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        return default_cache_dir()
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.default_cache_dir()


def check_inductor_cache(path: str, source: str, min_free: float = 2 * GIB) -> Check:
    """The inductor cache directory: exists or can be made, writable, free space."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check(
            "inductor_cache",
            "inductor cache",
            "fail",
            "not writable",
            f"{path} ({source}): {exc.strerror}",
            "export TORCHINDUCTOR_CACHE_DIR=<a writable dir with a few GiB free>",
        )
    free = shutil.disk_usage(path).free
    evidence = f"{path} ({source}), {_gib(free)} free"
    if free < min_free:
        return Check(
            "inductor_cache",
            "inductor cache",
            "warn",
            f"{_gib(free)} free",
            evidence,
            "compiled kernels need room: free space or point TORCHINDUCTOR_CACHE_DIR elsewhere",
        )
    if path.startswith(tempfile.gettempdir()) and source != RUN_CACHE:  # a workdir of the user's choice otherwise
        return Check(
            "inductor_cache",
            "inductor cache",
            "ok",
            f"writable, {_gib(free)} free",
            evidence,
            "under the temp dir it may be wiped on restart: set TORCHINDUCTOR_CACHE_DIR to keep compiles warm",
        )
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


# --- rows from the smoke tests ----------------------------------------------------------------


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
        evidence = (
            f"{' + '.join(detail['devices'])}; {warm} s; "
            f"final losses {' / '.join(f'{x:.4f}' for x in detail['losses'])}"
        )
        if not all(math.isfinite(x) for x in detail["losses"]):
            return Check(
                f"smoke:{policy}",
                title,
                "fail",
                f"loss not finite ({ms} ms/step)",
                evidence,
                "the step gives NaN or inf on this device: do not train with this policy",
            )
        if not detail["losses_agree"]:
            return Check(
                f"smoke:{policy}",
                title,
                "fail",
                f"losses disagree ({ms} ms/step)",
                evidence,
                "one replica trains on different numbers: do not train with this policy",
            )
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
        return (
            "CUDAGraph Trees are not thread-safe before torch 2.13; the trainer never uses them in threads "
            "(its cudagraphs policy turns trees off)"
        )
    if outcome == "hang":
        return f"compile: {policy} hangs in threads here: use another policy (stacks: --json, stderr_tail)"
    return f"compile: {policy} fails in threads here: set run.compile to a policy whose row is ok (traceback: --json)"


def trainer_policies(device_type: str) -> set[str]:
    """The doctor policies the trainer can end up with on this device (over every `run.compile` value)."""
    from .plan import COMPILE_MODES, choose_compile_policy

    return {choose_compile_policy(mode, device_type).effective for mode in COMPILE_MODES}


def launcher_verdict(gpus: int) -> str:
    """What `run.launcher: auto` picks on a box with this many GPUs: one pick and why where every
    width class of plan.THREADS_KEEP_UP gets it, else each class's (the model is the user's)."""
    from .plan import THREADS_KEEP_UP, launcher_decision

    devices = [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    head = f"launcher (run.launcher auto, {f'{gpus} GPU(s)' if gpus else 'no GPU'})"
    decisions = [launcher_decision("auto", devices, width) for width, _ in THREADS_KEEP_UP]
    picks = [which for which, _ in decisions]
    if len(set(picks)) == 1:  # the rule's own reason where it does not name a width
        reasons = {why for _, why in decisions}
        return f"{head}: {picks[0]} ({reasons.pop() if len(reasons) == 1 else 'at every target width'})"
    classes = []
    for i, ((width, _), which) in enumerate(zip(THREADS_KEEP_UP, picks)):
        upper = THREADS_KEEP_UP[i - 1][0] if i else None
        widths = f">= {width}" if upper is None else f"< {upper}" if width == 0 else f"{width}-{upper - 1}"
        classes.append(f"{which} for target hidden {widths}")
    return f"{head}: {', '.join(classes)}"


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
        return Check(
            "verdict", "verdict", "ok", result, f"{evidence}; not smoke-tested ({tested.get('error', 'not run')})"
        )
    if tested["outcome"] != "ok" or not tested["losses_agree"]:
        hint = (
            f"set run.compile: {faster} (its smoke test passed)" if faster else "no policy passed: see the rows above"
        )
        return Check(
            "verdict", "verdict", "fail", result + f": its smoke test gave {tested['outcome']}", evidence, hint
        )
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
