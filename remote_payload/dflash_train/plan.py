"""The run plan: every decision about how a run executes on this machine, made once, with its
reason. `resolve_run(cfg)` turns a config and the visible devices into a `RunPlan`: the worker
devices and what the run holds, the argv that pins a restart to them, dtype, the compile policy
and its scope, the CUDA graph captures, the launcher and the parallel warm-up. The trainer, the
workers, the replicas, the warm-up and launcher children read the plan; none decides again.
`python -m dflash_train --preflight` prints `preflight_answer(plan)` (dflashctl runs it in the
container before it starts a run; `dflashctl data regen`'s pre-flight answers in the same format).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from . import torch_build
from .compiling import CUDAGRAPH_OPTIONS, CompilePolicy
from .config import Config, ConfigError, RunConfig
from .resolve import fill_config, summary

COMPILE_MODES = ("off", "default", "cudagraphs")

# `run.compile_scope: auto` compiles per layer from this target width up (Qwen3-0.6B's): there the
# step is compute-bound, so the regional compile costs no speed, while one graph of the whole step
# takes minutes to compile (8B: not done after 10 min on an H200, against 24 s per layer).
LAYERS_SCOPE_MIN_HIDDEN = 1024

# `run.launcher: auto`: the predicted largest GPU count at which one thread per GPU keeps up with
# the GPU, by target hidden size. Threads share one GIL, so N threads need N x the host time of a
# step per GPU step: N_max ~= device ms/step / host ms/step, as bench/host_overhead.py measured on
# one H200 (2026-12-01, docs/threaded-compile.md): small (hidden 256, cudagraphs) 2.13 / 2.55 ms: 1;
# mid (hidden 2048, cudagraphs) 23.8-24.3 ms over 4.1-6.2 ms in three runs: 3 to 5, so 3; the 8B
# preset (hidden 4096, per-layer graphs) 218 / 65 ms: 3, and 212 / 60-61 ms with its target forward
# as one CUDA graph (run.capture_target): still 3, as the launch queue fills behind the graph. The host
# figures are upper bounds (the thread's whole busy time, waits in full launch queues and GIL-free
# calls included), so these are lower bounds.
THREADS_KEEP_UP = ((LAYERS_SCOPE_MIN_HIDDEN, 3), (0, 1))  # (from hidden size, N_max), widest first

# Forward/backward calls under the warm-up lock per effective compile mode: none eager, one to
# compile, two to compile and then capture the CUDA graphs (the tree-less path captures on the second).
WARMUP_STEPS = {"off": 0, "default": 1, "cudagraphs": 2}


@dataclass(frozen=True)
class DevicePlan:
    """The worker devices (one per worker thread, always indexed `cuda:N`), what the run holds
    (GPU indices as strings, or `cpu`), and the `--set` argv that pins a program to exactly them
    (empty where the config names its devices itself)."""

    workers: tuple[str, ...]
    holds: tuple[str, ...]
    pin: tuple[str, ...]
    reason: str

    @property
    def type(self) -> str:
        """`cuda` or `cpu`: every worker runs on one kind."""
        return self.workers[0].split(":")[0]


@dataclass(frozen=True)
class RunPlan:
    """How a run executes here (see the module docstring); `cfg` is the config with every
    `auto`/None filled in, as written to config.resolved.yaml."""

    cfg: Config
    devices: DevicePlan
    policy: CompilePolicy
    launcher: str  # threads | processes
    parallel_warmup: str  # on | off
    warmup_steps: int  # forward/backward calls per worker under the warm-up lock
    notes: tuple[str, ...]  # each decision with its reason, printed once at start

    def summary(self, n_params: int | None = None) -> list[str]:
        """The lines a run starts with: model, data, devices, compile policy, and every decision's reason."""
        return summary(self.cfg, list(self.notes), n_params)

    def to_json(self) -> dict:
        """The plan as JSON (the pre-flight's `plan`)."""
        p = self.policy
        return {
            "devices": list(self.devices.workers),
            "holds": list(self.devices.holds),
            "pin": list(self.devices.pin),
            "dtype": self.cfg.run.dtype,
            "compile": p.effective,
            "compile_requested": p.requested,
            "compile_scope": p.scope,
            "capture_target": p.capture_target,
            "capture_optimizer": p.capture_optimizer,
            "launcher": self.launcher,
            "parallel_warmup": self.parallel_warmup,
            "warmup_steps": self.warmup_steps,
            "attention": self.cfg.drafter.attention,
            "target_backend": self.cfg.target.backend,
            "reasons": list(self.notes),
        }


def preflight_answer(devices: DevicePlan, summary_lines: list[str], plan: dict) -> dict:
    """The one pre-flight answer of train, regen and eval: what the run holds, how to pin it, its
    devices, the lines to show and the plan."""
    return {
        "ok": True,
        "holds": list(devices.holds),
        "pin": list(devices.pin),
        "devices": list(devices.workers),
        "summary": summary_lines,
        "plan": plan,
    }


def resolve_run(
    cfg: Config, cuda_count: int | None = None, multi_host: bool = False, torch_version: str | None = None
) -> RunPlan:
    """The plan of `cfg` on a machine with `cuda_count` visible GPUs (default: what torch will see)
    and torch `torch_version` (default: the installed one's), found without importing torch;
    raises ConfigError on a config this machine cannot run. `multi_host`: this process is one node
    of a multi-host run (WORLD_SIZE > 1, docs/multihost.md)."""
    cfg = copy.deepcopy(cfg)
    notes: list[str] = []
    run = cfg.run
    devices = plan_devices(run, cuda_count, notes)
    on_cuda = devices.type == "cuda"
    if cfg.debug.fail_rank >= run.threads and (cfg.debug.fail_at or cfg.debug.hang_at):
        raise ConfigError(f"debug.fail_rank {cfg.debug.fail_rank} but only {run.threads} worker(s)")
    if run.dtype == "auto":
        run.dtype = "bf16" if on_cuda else "fp32"
    if run.compile is None:
        run.compile = "default" if on_cuda else "off"
        notes.append(f"compile: {run.compile} (run.compile unset: {'inductor on CUDA' if on_cuda else 'eager on CPU'})")
    if cfg.drafter.attention == "auto":
        cfg.drafter.attention = auto_attention(on_cuda, run.compile)
    if cfg.drafter.attention == "flex" and not on_cuda:
        raise ConfigError("drafter.attention flex needs CUDA (FlexAttention has no CPU backward)")
    fill_config(cfg, notes)
    if run.compile_scope == "auto":
        run.compile_scope, why = auto_compile_scope(cfg.target.hidden_size, run.compile)
        if run.compile != "off":
            notes.append(f"compile scope: {run.compile_scope} ({why})")
    # run.capture_target stays `auto` in the resolved config: an eval or resume on another device
    # or compile mode plans it afresh.
    capture, why = capture_target_decision(
        run.capture_target, on_cuda, run.compile, run.compile_scope, cfg.target.backend
    )
    if on_cuda and run.compile != "off":
        notes.append(f"target forward: {'one CUDA graph' if capture == 'on' else 'layer by layer'} ({why})")
    policy = dataclasses.replace(
        choose_compile_policy(run.compile, devices.type, torch_version),
        scope=run.compile_scope,
        capture_target=capture == "on",
    )
    # clip + AdamW + zero as one graph where the step runs under CUDA graphs (CUDA only)
    policy = dataclasses.replace(
        policy, capture_optimizer=run.capture_optimizer == "auto" and policy.effective == "cudagraphs"
    )
    launcher, parallel = _launch(cfg, devices.workers, multi_host, notes)
    return RunPlan(cfg, devices, policy, launcher, parallel, WARMUP_STEPS[policy.effective], tuple(notes))


def _launch(cfg: Config, devices: tuple[str, ...], multi_host: bool, notes: list[str]) -> tuple[str, str]:
    """(launcher, parallel warm-up) for these worker devices, filled into cfg.run and told in notes."""
    run = cfg.run
    run.launcher, why = launcher_decision(run.launcher, list(devices), cfg.target.hidden_size, multi_host)
    if run.launcher == "processes" and devices[0].startswith("cuda") and len(set(devices)) != len(devices):
        raise ConfigError(f"run.launcher processes needs a GPU of its own per worker, got {', '.join(devices)}")
    if len(devices) > 1:
        notes.append(f"launcher: {run.launcher} ({why})")
    if run.launcher == "processes" and run.parallel_warmup != "off":
        run.parallel_warmup, why = "off", "one process per device: they compile in parallel anyway"
    else:
        run.parallel_warmup, why = parallel_warmup_decision(run.parallel_warmup, list(devices), run.compile)
    if run.compile != "off":
        notes.append(f"parallel warm-up: {run.parallel_warmup} ({why})")
    return run.launcher, run.parallel_warmup


def plan_devices(run: RunConfig, cuda_count: int | None = None, notes: list[str] | None = None) -> DevicePlan:
    """The device part of the plan, alone (data regen has no training step to plan): the worker
    devices of `run` on a machine with `cuda_count` GPUs (default: what torch sees); fills run.device,
    run.gpus and run.threads in place, and each decision's line into `notes`."""
    count = torch_build.visible_gpus() if cuda_count is None else cuda_count
    return resolve_devices(run, count, [] if notes is None else notes)


def resolve_devices(run: RunConfig, count: int, notes: list[str]) -> DevicePlan:
    """The worker devices for `run.gpus` / `run.device` / `run.threads` on a machine with `count`
    GPUs; fills run.device (indexed), run.gpus and run.threads in place."""
    if run.gpus:
        if run.device not in ("auto", "cuda", f"cuda:{run.gpus[0]}"):
            raise ConfigError(f"run.gpus {run.gpus} contradicts run.device {run.device}: set one of them")
        if not count:
            raise ConfigError(f"run.gpus {run.gpus} requested but CUDA is not available")
        if max(run.gpus) >= count:
            raise ConfigError(f"run.gpus {run.gpus}: torch sees {count} GPU(s)")
        run.device, run.threads = f"cuda:{run.gpus[0]}", len(run.gpus)
        return _device_plan(run, (), "run.gpus", notes)
    if run.device == "auto":
        if count and run.threads == 0:
            run.gpus = list(range(count))
            run.device, run.threads = "cuda:0", count
            return _device_plan(
                run,
                ("--set", f"run.gpus=[{','.join(map(str, run.gpus))}]"),
                "run.device auto: every visible GPU, one thread each; choose with --gpus",
                notes,
            )
        run.device = "cuda:0" if count else "cpu"
        run.threads = run.threads or 1
        # A restart of the run must not move to another device: pinned to the one seen now.
        pin = ("--set", f"run.device={run.device}") if count else ()
        return _device_plan(run, pin, f"run.device auto: {'CUDA' if count else 'no CUDA'}", notes)
    kind, index = parse_device(run.device)
    if kind == "cuda":
        if not count:
            raise ConfigError(f"run.device {run.device} requested but CUDA is not available")
        index = 0 if index is None else index  # torch.cuda.set_device needs an index
        if index >= count:
            raise ConfigError(f"run.device {run.device}: torch sees {count} GPU(s)")
        run.device = f"cuda:{index}"
    run.threads = run.threads or 1
    return _device_plan(run, (), f"run.device {run.device}", notes)


def _device_plan(run: RunConfig, pin: tuple[str, ...], why: str, notes: list[str]) -> DevicePlan:
    """The DevicePlan of a filled run section, its line added to notes."""
    if run.gpus:
        workers = tuple(f"cuda:{g}" for g in run.gpus)
        notes.append(f"devices: {', '.join(workers)} ({why})")
    else:
        workers = (run.device,) * run.threads
        replicas = f"{run.threads} x {run.device}" if run.threads > 1 else run.device
        notes.append(f"devices: {replicas} ({why}{'; run.threads' if run.threads > 1 else ''})")
    holds = tuple(sorted({d.split(":")[1] for d in workers if d.startswith("cuda:")}, key=int)) or ("cpu",)
    return DevicePlan(workers, holds, pin, why)


def auto_attention(on_cuda: bool, compile_mode: str) -> str:
    """`drafter.attention: auto`: FlexAttention when it can be compiled (CUDA and compiling), else
    dense SDPA. `run.compile: off` is the escape hatch from a broken compiler, so it must not
    compile anything, and eager flex is only a slow dense reference."""
    return "flex" if on_cuda and compile_mode != "off" else "dense"


def auto_compile_scope(hidden_size: int, compile_mode: str) -> tuple[str, str]:
    """(scope, reason) for `run.compile_scope: auto`."""
    if compile_mode == "off":
        return "step", "nothing is compiled (run.compile off)"
    if compile_mode == "cudagraphs":
        return "step", "CUDA graphs capture the whole step (per-layer graphs cannot use them)"
    if hidden_size >= LAYERS_SCOPE_MIN_HIDDEN:
        return "layers", (
            f"hidden size {hidden_size} >= {LAYERS_SCOPE_MIN_HIDDEN}: each layer compiles once and "
            f"is reused (seconds); one whole-step graph would take minutes"
        )
    return "step", f"hidden size {hidden_size} < {LAYERS_SCOPE_MIN_HIDDEN}: the whole step as one graph (launch-bound)"


def threads_keep_up(hidden_size: int) -> int:
    """THREADS_KEEP_UP's N_max for this target width."""
    return next(n for width, n in THREADS_KEEP_UP if hidden_size >= width)


def launcher_decision(setting: str, devices: list[str], hidden_size: int, multi_host: bool = False) -> tuple[str, str]:
    """(threads | processes, reason) for `run.launcher` on these worker devices; `multi_host`: this
    process is one node of a multi-host run (docs/multihost.md), which uses threads inside."""
    gpus = len({d for d in devices if d.startswith("cuda")})
    if multi_host:
        if setting == "processes":
            raise ConfigError(
                "run.launcher processes joins one host's devices as a group: a multi-host run "
                "already runs one process per host (use threads or auto)"
            )
        return "threads", "a multi-host run: one process per host, one thread per GPU inside"
    if setting != "auto":
        return setting, f"run.launcher {setting}"
    keep_up = threads_keep_up(hidden_size)
    if gpus <= 1:
        return "threads", "one device"
    if gpus > keep_up:
        return "processes", (
            f"{gpus} GPUs > {keep_up}, the GPU count threads are predicted to keep up with "
            f"at target hidden size {hidden_size} (one GIL for all): one process per GPU"
        )
    return "threads", (
        f"{gpus} GPUs <= {keep_up}, the GPU count threads are predicted to keep up with at "
        f"target hidden size {hidden_size}: one thread per GPU"
    )


def capture_target_decision(
    setting: str, on_cuda: bool, compile_mode: str, scope: str, backend: str = "native"
) -> tuple[str, str]:
    """(on | off, reason) for `run.capture_target`: the target's feature forward as one CUDA graph
    per step where it otherwise launches layer by layer from Python."""
    why_not = None
    if backend == "transformers":
        # On an H200 (2026-12-02) the llama3-8b preset's captured forward compiled its first layer
        # inside the capture, which CUDA refuses (cudaErrorStreamCaptureUnsupported).
        why_not = "a transformers target: its compiled layers are not warmed before a capture"
    elif not on_cuda:
        why_not = "CUDA graphs need CUDA"
    elif compile_mode == "off":
        why_not = "run.compile off: the plain eager path"
    elif compile_mode == "cudagraphs":
        why_not = "run.compile cudagraphs: the whole step, target included, is one graph already"
    elif scope == "step":
        why_not = "compile scope step: the target is traced into the step's compiled graph"
    if setting == "off":
        return "off", "run.capture_target off"
    if why_not is not None:
        if setting == "on":
            raise ConfigError(f"run.capture_target on cannot be used here: {why_not}")
        return "off", why_not
    because = "run.capture_target on" if setting == "on" else f"compile scope {scope}"
    return "on", (
        f"{because}: replayed in one launch per step instead of layer by layer from Python; "
        f"run.capture_target off launches it layer by layer"
    )


def parallel_warmup_decision(setting: str, devices: list[str], compile_mode: str) -> tuple[str, str]:
    """(on | off, reason) for `run.parallel_warmup` given the worker devices and `run.compile`.

    The worker threads compile one after another (Dynamo's compile_lock, and our warm-up lock for
    CUDA graph capture), and a compile for cuda:1 cannot reuse cuda:0's (the cache keys hold the
    device), so N GPUs pay N compiles. Processes compile in parallel and share the on-disk cache."""
    distinct = sorted(set(devices))
    if compile_mode == "off":
        return "off", "run.compile off: nothing to compile"
    if setting == "off":
        return "off", "run.parallel_warmup off: the threads compile one after another"
    if setting == "on":
        return "on", f"run.parallel_warmup on: one process per device ({', '.join(distinct)})"
    cuda = [d for d in distinct if d.startswith("cuda")]
    if len(cuda) < 2:
        return "off", (
            "one device: nothing to compile in parallel" if len(distinct) == 1 else "CPU workers share one device"
        )
    return "on", (
        f"{len(cuda)} GPUs and compile {compile_mode}: one process per GPU compiles the step at once "
        f"into the compile cache; the threads then compile from it instead of one after another"
    )


def torch_version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def parse_device(text: str) -> tuple[str, int | None]:
    """`cpu`, `cuda` or `cuda:N` as (type, index or None), read as torch.device reads them;
    ConfigError for anything else."""
    kind, _, index = text.partition(":")
    if not kind.isidentifier() or (index and not index.isdigit()) or text.endswith(":"):
        raise ConfigError(f"run.device {text!r} is not a device (cpu, cuda, cuda:N)")
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"run.device {text!r}: the trainer runs on cpu or cuda")
    return kind, int(index) if index else None


def choose_compile_policy(mode: str, device_type: str, version: str | None = None) -> CompilePolicy:
    """The compile policy for worker threads, from the config's `compile` and the torch version
    (scope and captures are added by `resolve_run`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "off":
        return CompilePolicy(mode, "off", None, "eager")
    if mode == "default" or device_type != "cuda":
        why = "inductor without CUDA graphs" if mode == "default" else "CUDA graphs need CUDA: default compile"
        return CompilePolicy(mode, "default", None, why)
    ver = torch_version_tuple(version or torch_build.installed().version)
    if ver < (2, 12):
        why = (
            "CUDAGraph Trees keep their state in TLS stashed only by the importing thread "
            "(AssertionError in workers, measured on 2.11): trees off, per call"
        )
    elif ver < (2, 13):
        why = "trees not thread-aware yet and inductor config is per-thread: trees off, passed per torch.compile call"
    else:
        why = (
            "trees initialise per-thread state since 2.13, but are unmeasured in worker "
            "threads here: trees off (measured safe), passed per torch.compile call"
        )
    return CompilePolicy(mode, "cudagraphs", dict(CUDAGRAPH_OPTIONS), why)
