"""Config resolution: every `auto`/None of a run config decided for this machine, each decision
with its reason, without building a model. `python -m dflash_train --preflight` prints the result
as one JSON line (dflashctl runs it in the container before it starts a run)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from .config import Config, ConfigError
from .loss import default_gamma
from .model import DrafterSpec
from .recipe import recipe_for_target
from .sliding import check_layer_types
from .target import default_target_layer_ids, resolve_mask_token_id, shape_of
from .target_hf import drafter_rope, resolve_target_config

# `run.compile_scope: auto` compiles per layer from this target width up (Qwen3-0.6B's): there the
# step is compute-bound, so the regional compile costs no speed, while one graph of the whole step
# takes minutes to compile (8B: not done after 10 min on an H200, against 24 s per layer).
LAYERS_SCOPE_MIN_HIDDEN = 1024
DATASET_PREFIX = "data:"  # data.train_path: data:NAME is <data.dir>/NAME (`dflashctl data push`)


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
        return "layers", (f"hidden size {hidden_size} >= {LAYERS_SCOPE_MIN_HIDDEN}: each layer compiles once and "
                          f"is reused (seconds); one whole-step graph would take minutes")
    return "step", f"hidden size {hidden_size} < {LAYERS_SCOPE_MIN_HIDDEN}: the whole step as one graph (launch-bound)"


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


def threads_keep_up(hidden_size: int) -> int:
    """THREADS_KEEP_UP's N_max for this target width."""
    return next(n for width, n in THREADS_KEEP_UP if hidden_size >= width)


def launcher_decision(setting: str, devices: list[str], hidden_size: int, multi_host: bool = False) -> tuple[str, str]:
    """(threads | processes, reason) for `run.launcher` on these worker devices; `multi_host`: this
    process is one node of a multi-host run (docs/multihost.md), which uses threads inside."""
    gpus = len({d for d in devices if d.startswith("cuda")})
    if multi_host:
        if setting == "processes":
            raise ConfigError("run.launcher processes joins one host's devices as a group: a multi-host run "
                              "already runs one process per host (use threads or auto)")
        return "threads", "a multi-host run: one process per host, one thread per GPU inside"
    if setting != "auto":
        return setting, f"run.launcher {setting}"
    keep_up = threads_keep_up(hidden_size)
    if gpus <= 1:
        return "threads", "one device"
    if gpus > keep_up:
        return "processes", (f"{gpus} GPUs > {keep_up}, the GPU count threads are predicted to keep up with "
                             f"at target hidden size {hidden_size} (one GIL for all): one process per GPU")
    return "threads", (f"{gpus} GPUs <= {keep_up}, the GPU count threads are predicted to keep up with at "
                       f"target hidden size {hidden_size}: one thread per GPU")


def capture_target_decision(setting: str, on_cuda: bool, compile_mode: str, scope: str) -> tuple[str, str]:
    """(on | off, reason) for `run.capture_target`: the target's feature forward as one CUDA graph
    per step where it otherwise launches layer by layer from Python."""
    why_not = None
    if not on_cuda:
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
    return "on", (f"{because}: replayed in one launch per step instead of layer by layer from Python; "
                  f"run.capture_target off launches it layer by layer")


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
        return "off", ("one device: nothing to compile in parallel" if len(distinct) == 1 else
                       "CPU workers share one device")
    return "on", (f"{len(cuda)} GPUs and compile {compile_mode}: one process per GPU compiles the step at once "
                  f"into the compile cache; the threads then compile from it instead of one after another")


def _resolve_devices(cfg: Config, notes: list[str]) -> None:
    """Fill run.device, run.gpus and run.threads; devices are always indexed (`cuda:N`)."""
    run = cfg.run
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    if run.gpus:
        if run.device not in ("auto", "cuda", f"cuda:{run.gpus[0]}"):
            raise ConfigError(f"run.gpus {run.gpus} contradicts run.device {run.device}: set one of them")
        if not cuda:
            raise ConfigError(f"run.gpus {run.gpus} requested but CUDA is not available")
        if max(run.gpus) >= count:
            raise ConfigError(f"run.gpus {run.gpus}: torch sees {count} GPU(s)")
        run.device, run.threads = f"cuda:{run.gpus[0]}", len(run.gpus)
        notes.append(f"devices: {', '.join(f'cuda:{g}' for g in run.gpus)} (run.gpus)")
        return
    why = f"run.device {run.device}"
    if run.device == "auto":
        if cuda and run.threads == 0:
            run.gpus = list(range(count))
            run.device, run.threads = "cuda:0", count
            notes.append(f"devices: {', '.join(f'cuda:{g}' for g in run.gpus)} (run.device auto: every visible GPU, "
                         f"one thread each; choose with --gpus)")
            return
        run.device = "cuda:0" if cuda else "cpu"
        why = f"run.device auto: {'CUDA' if cuda else 'no CUDA'}"
    try:
        device = torch.device(run.device)
    except RuntimeError:
        raise ConfigError(f"run.device {run.device!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device {run.device!r}: the trainer runs on cpu or cuda")
    if device.type == "cuda":
        if not cuda:
            raise ConfigError(f"run.device {run.device} requested but CUDA is not available")
        index = 0 if device.index is None else device.index  # torch.cuda.set_device needs an index
        if index >= count:
            raise ConfigError(f"run.device {run.device}: torch sees {count} GPU(s)")
        run.device = f"cuda:{index}"
    run.threads = run.threads or 1
    replicas = f"{run.threads} x {run.device}" if run.threads > 1 else run.device
    notes.append(f"devices: {replicas} ({why}{'; run.threads' if run.threads > 1 else ''})")


def resolve_config(cfg: Config, notes: list[str] | None = None, multi_host: bool = False) -> Config:
    """A copy with every `auto`/None filled in (devices, dtype, compile, scope, attention, target
    shape, feature layers, MASK id, gamma, export dir); raises ConfigError on inconsistencies.
    Each decision that depends on the machine or the model is appended to `notes` with its reason.
    `multi_host`: this process is one node of a multi-host run (WORLD_SIZE > 1)."""
    cfg = copy.deepcopy(cfg)
    notes = [] if notes is None else notes
    run, d = cfg.run, cfg.drafter
    _resolve_devices(cfg, notes)
    on_cuda = run.device.startswith("cuda")
    if cfg.debug.fail_rank >= run.threads and (cfg.debug.fail_at or cfg.debug.hang_at):
        raise ConfigError(f"debug.fail_rank {cfg.debug.fail_rank} but only {run.threads} worker(s)")
    if run.dtype == "auto":
        run.dtype = "bf16" if on_cuda else "fp32"
    if run.compile is None:
        run.compile = "default" if on_cuda else "off"
        notes.append(f"compile: {run.compile} (run.compile unset: {'inductor on CUDA' if on_cuda else 'eager on CPU'})")
    if d.attention == "auto":
        d.attention = auto_attention(on_cuda, run.compile)
    if d.attention == "flex" and not on_cuda:
        raise ConfigError("drafter.attention flex needs CUDA (FlexAttention has no CPU backward)")
    cfg.target = resolve_target_config(cfg.target, notes)
    _fill_recipe(cfg, notes)
    if run.compile_scope == "auto":
        run.compile_scope, why = auto_compile_scope(cfg.target.hidden_size, run.compile)
        if run.compile != "off":
            notes.append(f"compile scope: {run.compile_scope} ({why})")
    if run.compile == "cudagraphs" and run.compile_scope == "layers":
        raise ConfigError("run.compile_scope layers cannot use run.compile cudagraphs (use step)")
    # Checked and told here, decided again where the replica is built (`auto` stays `auto` in the
    # resolved config, so an eval or resume on another device or compile mode resolves it afresh).
    capture, why = capture_target_decision(run.capture_target, on_cuda, run.compile, run.compile_scope)
    if on_cuda and run.compile != "off":
        notes.append(f"target forward: {'one CUDA graph' if capture == 'on' else 'layer by layer'} ({why})")
    devices = worker_devices(cfg)
    run.launcher, why = launcher_decision(run.launcher, devices, cfg.target.hidden_size, multi_host)
    if run.launcher == "processes" and on_cuda and len(set(devices)) != len(devices):
        raise ConfigError(f"run.launcher processes needs a GPU of its own per worker, got {', '.join(devices)}")
    if len(devices) > 1:
        notes.append(f"launcher: {run.launcher} ({why})")
    if run.launcher == "processes" and run.parallel_warmup != "off":
        run.parallel_warmup, why = "off", "one process per device: they compile in parallel anyway"
    else:
        run.parallel_warmup, why = parallel_warmup_decision(run.parallel_warmup, devices, run.compile)
    if run.compile != "off":
        notes.append(f"parallel warm-up: {run.parallel_warmup} ({why})")
    if d.target_layer_ids is None:
        d.target_layer_ids = default_target_layer_ids(cfg.target.num_layers, d.num_target_features)
    if not d.target_layer_ids or not all(0 <= i < cfg.target.num_layers for i in d.target_layer_ids):
        raise ConfigError(f"drafter.target_layer_ids {d.target_layer_ids} must lie in "
                          f"[0, {cfg.target.num_layers - 1}]")
    try:
        d.mask_token_id = resolve_mask_token_id(cfg.target, d.mask_token_id, cfg.data.tokenizer_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_layer_types(d.layer_types, d.sliding_window, d.num_layers)
    for key in ("train_path", "eval_path"):
        path = getattr(cfg.data, key)
        if path is not None and path.startswith(DATASET_PREFIX):
            if cfg.data.dir is None:
                raise ConfigError(f"data.{key} {path}: a pushed dataset needs data.dir (dflashctl train sets it)")
            setattr(cfg.data, key, str(Path(cfg.data.dir) / path[len(DATASET_PREFIX):]))
    if cfg.optim.gamma is None:
        cfg.optim.gamma = default_gamma(d.block_size)
    if run.export_dir is None:
        run.export_dir = str(Path(run.output_dir) / "export")
    return cfg


def _fill_recipe(cfg: Config, notes: list[str]) -> None:
    """Fill the recipe fields left None (the real-target preset) from the target's size."""
    recipe = recipe_for_target(cfg.target.hidden_size)
    filled = []
    for section, name in (("drafter", "num_layers"), ("data", "max_length"), ("data", "anchors_per_seq"),
                          ("data", "batch_size")):
        if getattr(getattr(cfg, section), name) is None:
            setattr(getattr(cfg, section), name, getattr(recipe, name))
            filled.append(f"{section}.{name} {getattr(recipe, name)}")
    if filled:
        notes.append(f"recipe: {', '.join(filled)} ({recipe.reason})")
        if cfg.data.max_length < cfg.drafter.block_size + 1:
            raise ConfigError("data.max_length must exceed drafter.block_size")


PRESET_MEANING = {
    "tiny": "a random tiny target on its own greedy text: a first run and the tests (seconds on a CPU)",
    "real-target": "the recipe for a real checkpoint: target.path set, no --preset",
    "qwen3-8b": ("random weights on random tokens at Qwen3-8B's shape: measures speed and memory, never quality "
                 "(tau is 1.0 by construction); train on your checkpoint with --set target.path=DIR"),
    "llama3-8b": "random weights at Llama-3.1-8B's shape through transformers: speed and memory only",
    "qwen3-30b-a3b": "random weights at Qwen3-30B-A3B's shape (MoE) through transformers: speed and memory only",
}


def drafter_spec(cfg: Config) -> DrafterSpec:
    """The drafter's architecture from a resolved config."""
    d = cfg.drafter
    shape = dataclasses.replace(shape_of(cfg.target), rope_scaling=drafter_rope(cfg.target))
    return DrafterSpec(shape, d.num_layers, d.block_size, tuple(d.target_layer_ids), d.mask_token_id,
                       check_layer_types(d.layer_types, d.sliding_window, d.num_layers), d.sliding_window)


def worker_devices(cfg: Config) -> list[str]:
    """One device per worker thread of a resolved config: the GPUs of `run.gpus`, else
    `run.threads` replicas on `run.device`."""
    if cfg.run.gpus:
        return [f"cuda:{g}" for g in cfg.run.gpus]
    return [cfg.run.device] * cfg.run.threads


def check_data_paths(cfg: Config) -> None:
    """The data files a jsonl run reads exist (a pre-flight check; their rows are read at start)."""
    if cfg.data.source != "jsonl":
        return
    for key in ("train_path", "eval_path"):
        path = getattr(cfg.data, key)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"data.{key}: no such file: {path}")


def summary(cfg: Config, notes: list[str], n_params: int | None = None) -> list[str]:
    """The few lines a run starts with: model, data, devices, compile policy and why."""
    t, d, data, run = cfg.target, cfg.drafter, cfg.data, cfg.run
    target = t.path or (f"random {t.model_type} shape ({t.num_layers} layers, hidden {t.hidden_size}, "
                        f"vocab {t.vocab_size})")
    source = data.train_path if data.source == "jsonl" else f"{data.source} ({data.num_train} sequences)"
    params = "" if n_params is None else f", {n_params / 1e6:.2f}M trainable parameters"
    meaning = PRESET_MEANING.get(cfg.preset, "")
    if cfg.preset != "real-target" and t.path is not None:
        meaning = f"the {cfg.preset} preset's recipe on a real target (without --preset it gets real-target's)"
    lines = [
        f"preset: {cfg.preset}{f' ({meaning})' if meaning else ''}",
        f"target: {target}",
        f"drafter: {d.num_layers} layer(s), block {d.block_size}{params}, "
        f"features from target layers {d.target_layer_ids}, MASK id {d.mask_token_id}",
        f"data: {source}, max length {data.max_length}, {data.anchors_per_seq} anchors/sequence, "
        f"batch {data.batch_size} per worker",
        f"run: {run.steps} steps, lr {cfg.optim.lr:g}, {run.dtype}, compile {run.compile}"
        f"{'' if run.compile == 'off' else f' ({run.compile_scope} scope)'}, attention {d.attention}",
    ]
    return lines + notes
