"""Typed run configuration: nested dataclasses, built-in presets, YAML files and `--set` overrides."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad configuration: the message is one line, meant for the user."""


@dataclass
class TargetConfig:
    """The frozen target model: a local HF causal-LM directory, or a random one of this shape."""

    path: str | None = None  # HF checkpoint dir; None builds a random target from the fields below
    backend: Literal["auto", "native", "transformers"] = (
        "auto"  # native: our Qwen3 (target.py); transformers: any causal LM (target_hf.py)
    )
    model_type: str = "qwen3"  # the HF architecture (read from config.json when path is set)
    seed: int = 0  # init seed of the random target
    num_layers: int = 6
    hidden_size: int = 64
    intermediate_size: int = 192
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    init_std: float = 0.07  # random target only: 0.07 gives greedy text with runs and jumps (learnable)
    rope_scaling: dict[str, Any] | None = None  # HF rope parameters beyond theta (e.g. Llama 3's rope_type llama3)
    attention_bias: bool = False  # Qwen2-style q/k/v biases (transformers backend only)
    num_experts: int = 0  # > 0: a mixture-of-experts target (random qwen3_moe-style shapes)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0


@dataclass
class DrafterConfig:
    """The DFlash drafter: width comes from the target, depth and block from here."""

    num_layers: int | None = 1  # None: from the target's size (recipe.py; the real-target preset)
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # None: `num_target_features` spread evenly (see target.py)
    num_target_features: int = 5
    mask_token_id: int | None = None  # None: `<|MASK|>` from the tokenizer, or the last id of a random target
    layer_types: list[str] | None = None  # per layer full_attention | sliding_attention; None: all full
    sliding_window: int | None = None  # the sliding layers' window in positions (z-lab's config.json field)
    attention: Literal["auto", "flex", "dense"] = "auto"  # auto: flex on CUDA unless run.compile off, else dense
    init_std: float = 0.02


@dataclass
class DataConfig:
    """Where sequences come from and how blocks are sampled from them."""

    source: Literal["demo", "jsonl", "random"] = "demo"  # demo: greedy continuations of the random target
    train_path: str | None = None  # jsonl rows: {"input_ids", "loss_mask"} or {"messages"};
    # `data:NAME` is a dataset pushed with `dflashctl data push` (in data.dir)
    dir: str | None = None  # where `data:NAME` paths live; dflashctl sets <workdir>/data
    eval_path: str | None = None  # held-out jsonl; None holds out `eval_fraction` of train
    eval_fraction: float = 0.05
    tokenizer_path: str | None = None  # for chat rows; None uses target.path
    max_length: int | None = 64  # None (real-target preset): from the target's size (recipe.py)
    anchors_per_seq: int | None = 8  # likewise
    batch_size: int | None = 8  # likewise
    num_train: int = 256  # demo/random: number of training sequences
    num_eval: int = 32  # demo/random: number of held-out sequences
    prompt_length: int = 8  # demo: random prompt tokens before the greedy continuation
    spec_prompts_path: str | None = None  # prompts of the in-training speculative decode (jsonl rows
    # as `dflashctl eval --prompts` takes, `data:NAME` too); None: the held-out split's


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (paper defaults)."""

    lr: float = 6e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; None: 7 for block 16, 5 for 10, 4 for 8 (see loss.py)
    loss_chunk_rows: int = 1024  # rows of LM-head logits materialised at once


@dataclass
class RunConfig:
    """Length, cadence, placement and output of one training run."""

    steps: int | None = 300  # None (real-target preset): recipe.DEFAULT_EPOCHS epochs of the data
    epochs: int = 0  # > 0 overrides steps with epochs * batches per epoch
    log_every: int = 10
    eval_every: int | None = 100  # None (real-target preset): recipe.EVALUATIONS a run (recipe.cadence_for)
    eval_batches: int = 4
    spec_prompts: int = 4  # held-out prompts decoded speculatively at each evaluation after step 0
    # (the real acceptance length, `spec_tau`); 0: off. Needs the whole target: it is built to its
    # last layer (not only to the last feature layer), which costs memory, not step time.
    spec_new_tokens: int = 32  # tokens generated per prompt by that decode
    checkpoint_every: int | None = 100  # None (real-target preset): likewise, at most recipe.CHECKPOINT_STEPS
    keep_checkpoints: int = 2
    seed: int = 0
    cpu_threads: int = 1  # torch intra-op threads; tiny ops gain nothing from more, and OpenMP
    # spin-waits make 2 threads 10x slower on a busy 2-core machine; 0 keeps torch's default
    output_dir: str = "runs/tiny"
    device: str = "auto"  # auto (every visible GPU, one thread each; else cpu) | cpu | cuda (= cuda:0) | cuda:N
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    compile: Literal["off", "default", "cudagraphs"] | None = None  # None: off on CPU, default on CUDA
    compile_scope: Literal["auto", "step", "drafter", "layers"] = (
        "auto"  # auto: layers for models of Qwen3-0.6B width and up, else step |
    )
    # step: the whole forward+loss as one graph (minutes to compile at 8B scale) | drafter: only
    # the drafter | layers: each draft and target layer (regional; not with cudagraphs)
    compile_cache_dir: str | None = None  # Inductor/Triton caches (TORCHINDUCTOR_CACHE_DIR); None:
    # torch's default under /tmp. dflashctl sets <workdir>/cache/compile so a second run starts warm
    bytecode_cache_dir: str | None = None  # compiled bytecode of torch's source when its install has
    # none and Python may not write it there (bytecode.py); None: Python's own. dflashctl sets
    # <workdir>/cache/bytecode
    launcher: Literal["auto", "threads", "processes"] = (
        "auto"  # threads (one thread per device, this process) | processes (one process
    )
    # per device, joined like the hosts of a multi-host run) | auto: processes where threads are
    # predicted not to keep up with the GPUs (plan.THREADS_KEEP_UP), else threads
    parallel_warmup: Literal["auto", "on", "off"] = "auto"  # before the worker threads start, one short-lived
    # process per device compiles the step once, in parallel, into the on-disk compile cache (the
    # threads' compiles are serialised); auto: on with more than one CUDA device and compile on
    capture_optimizer: Literal["auto", "off"] = "auto"  # auto: where the step runs under CUDA graphs (run.compile
    # cudagraphs), gradient clipping, AdamW (capturable, lr a device tensor) and zeroing the
    # gradients replay as one captured CUDA graph per step | off: eager fused AdamW as before
    capture_target: Literal["auto", "on", "off"] = "auto"  # on: the frozen target's feature forward replays as one CUDA
    # graph per step (target_graph.py) | off: launched layer by layer | auto: on with CUDA, compile
    # default and compile scope layers or drafter (under cudagraphs it is in the step's graph)
    warmup_timeout_s: float = 900.0  # a warm-up process still running after this is killed (the
    # threads then compile without it)
    gpus: list[int] = field(default_factory=list)  # one worker thread per listed GPU; empty: run.device
    threads: int = 0  # worker threads; 0: one per entry of gpus (else 1); N > 1 without gpus: N
    # replicas on run.device (CPU tests of the data-parallel path)
    barrier_timeout_s: float = 1800.0  # a worker not reaching the next step's barrier in this time is an error
    compile_timeout_s: float = 1800.0  # same for start-up waits (the build/compile lock, the barriers
    # before step 1), which include the other workers' builds and compiles
    export_dir: str | None = None  # None: <output_dir>/export
    tensorboard: bool = False  # also write the logged scalars as TensorBoard events in <output_dir>/tensorboard


@dataclass
class DistConfig:
    """Multi-host tuning (docs/multihost.md): rendezvous, collective and liveness timeouts."""

    timeout_s: float = 1800.0  # collective timeout, a backstop (the first GPU steps compile for minutes)
    rendezvous_timeout_s: float = 300.0  # every node must have joined by then
    heartbeat_s: float = 1.0  # each node bumps its heartbeat counter this often
    lost_after_s: float = 15.0  # a peer whose heartbeat stalls this long is lost


@dataclass
class DebugConfig:
    """Fault injection for tests of the failure paths (and `dflashctl doctor --inject`)."""

    fail_at: str | None = None  # build | compile | step:K (K from 1): raise InjectedFault there
    hang_at: str | None = None  # same places: block forever there (a stalled worker)
    stop_at: str | None = None  # same places: request a stop there, as a SIGTERM at that moment would
    fail_rank: int = 0  # which worker fails or hangs
    fail_checkpoint: int | None = None  # the step whose checkpoint write raises InjectedFault before its meta


@dataclass
class Config:
    """A whole run."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    preset: str = "tiny"  # the preset this config was built on (load_config chooses it)


# The random-token data of the speed presets at real width (qwen3-8b, llama3-8b, qwen3-30b-a3b).
_SPEED_DATA = {
    "source": "random",
    "max_length": 3072,
    "anchors_per_seq": 512,
    "batch_size": 1,
    "num_train": 64,
    "num_eval": 4,
}

# Presets are override dicts on top of the dataclass defaults (which are the tiny run). Without
# --preset (or a config file's `preset:`), a run with target.path gets `real-target`, else `tiny`.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"optim": {"lr": 2e-3}},  # the tiny drafter learns faster than the paper's 6e-4 allows
    # A user's own checkpoint: block 16 as z-lab's published drafters; depth, sequence shapes and
    # run length (None) follow the target's size and the data (recipe.py, resolve.fill_config), the
    # evaluation and checkpoint cadence the run length (recipe.cadence_for, once it is known).
    "real-target": {
        "drafter": {"num_layers": None, "block_size": 16},
        "data": {"max_length": None, "anchors_per_seq": None, "batch_size": None},
        # In-training tau on as many prompts and tokens as `dflashctl eval`'s defaults, so the two agree.
        "run": {"steps": None, "spec_prompts": 16, "spec_new_tokens": 64, "eval_every": None, "checkpoint_every": None},
    },
    "qwen3-8b": {
        "target": {
            "num_layers": 36,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "init_std": 0.02,
        },
        "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 151669},
        "data": {**_SPEED_DATA},
        "run": {"output_dir": "runs/qwen3-8b", "dtype": "bf16", "eval_every": 1000, "checkpoint_every": 1000},
    },
    # Llama-3.1-8B's shape through the transformers backend (random weights, random tokens, as
    # qwen3-8b): its rope scaling goes into the drafter's rope; MASK is <|reserved_special_token_0|>.
    "llama3-8b": {
        "target": {
            "model_type": "llama",
            "num_layers": 32,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "init_std": 0.02,
        },
        "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 128002},
        "data": {**_SPEED_DATA},
        "run": {"output_dir": "runs/llama3-8b", "dtype": "bf16", "eval_every": 1000, "checkpoint_every": 1000},
    },
    # Qwen3-30B-A3B's shape (128 experts, 8 active) through the transformers backend, likewise.
    "qwen3-30b-a3b": {
        "target": {
            "model_type": "qwen3_moe",
            "num_layers": 48,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_heads": 32,
            "num_kv_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "init_std": 0.02,
        },
        "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 151669},
        "data": {**_SPEED_DATA},
        "run": {"output_dir": "runs/qwen3-30b-a3b", "dtype": "bf16", "eval_every": 1000, "checkpoint_every": 1000},
    },
}


def load_config(path: str | None = None, preset: str | None = None, overrides: list[str] = ()) -> Config:
    """Preset (default tiny), then the YAML file, then `a.b=c` overrides, validated."""
    file_data: dict[str, Any] = {}
    if path is not None:
        file_data = read_yaml(path) or {}
        if not isinstance(file_data, dict):
            raise ConfigError(f"config {path} must be a mapping at top level")
    explicit = preset or file_data.pop("preset", None)
    file_data.pop("preset", None)
    cfg = _build(explicit or "tiny", file_data, overrides)
    if explicit is None and cfg.target.path is not None:  # the recipe follows the target
        cfg = _build("real-target", file_data, overrides)
    validate(cfg)
    return cfg


def _build(preset: str, file_data: dict[str, Any], overrides: list[str]) -> Config:
    """The preset, then the file's keys, then the overrides."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    cfg = Config(preset=preset)
    _apply_dict(cfg, PRESETS[preset], "")
    _apply_dict(cfg, file_data, "")
    for item in overrides:
        set_override(cfg, item)
    return cfg


def set_override(cfg: Config, item: str) -> None:
    """Apply one `a.b=value` override. The value is YAML (`run.gpus=[0,1]`, `target.path=null`),
    except that a string field takes text YAML cannot read or reads as a mapping, list or number
    as the plain string it is (`run.export_dir={run_dir}/export` needs no quotes)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key=value")
    dotted = key.strip()
    section, name, hint = _field(cfg, dotted)
    if not raw.strip():
        value = None
    else:
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            if not _takes_str(hint):
                why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ConfigError(f"{dotted}: the value {raw!r} is not valid YAML ({why})") from None
            value = raw.strip()
        if _takes_str(hint) and isinstance(value, (dict, list, int, float)) and not isinstance(value, bool):
            value = raw.strip()
    setattr(section, name, _coerce(value, hint, dotted))


def _field(cfg: Config, dotted: str) -> tuple[Any, str, Any]:
    """(section, field name, type hint) of a dotted key; ConfigError naming the known keys if none."""
    section_name, _, name = dotted.partition(".")
    sections = [s for s in _field_names(cfg) if dataclasses.is_dataclass(getattr(cfg, s))]
    if section_name == "preset":  # a top-level field, not a section: chosen before any override applies
        raise ConfigError(f"{dotted} is not a key to set: give --preset NAME (or `preset:` in the config file)")
    if section_name not in sections:
        raise ConfigError(f"unknown config key {dotted!r} (sections: {', '.join(sections)})")
    section = getattr(cfg, section_name)
    if not name:
        keys = ", ".join(_field_names(section))
        raise ConfigError(f"{section_name} is a section: give {section_name}.KEY=VALUE (keys: {keys})")
    if name not in _field_names(section):
        raise ConfigError(f"unknown config key {dotted!r} (keys in {section_name}: {', '.join(_field_names(section))})")
    return section, name, typing.get_type_hints(type(section))[name]


def _takes_str(hint: Any) -> bool:
    """Whether a field's type is str or a choice of strings (`Literal[...]`), optional or not."""
    if hint is str or typing.get_origin(hint) is Literal:
        return True
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and any(map(_takes_str, typing.get_args(hint)))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML/JSON)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def choices(hint: Any) -> tuple | None:
    """The values a field's `Literal[...]` type allows (None among them for `Literal[...] | None`);
    None for a field that is not a choice."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        literal = [a for a in args if typing.get_origin(a) is Literal]
        if literal:
            return typing.get_args(literal[0]) + ((None,) if type(None) in args else ())
    return None


def validate(cfg: Config) -> None:
    """Reject values that are well-typed but meaningless."""
    _check_choices(cfg)
    _check_counts(cfg)
    _check_run(cfg)


def _check_choices(cfg: Config) -> None:
    """Every field with a Literal type holds one of its choices."""
    for section_name in _field_names(cfg):
        section = getattr(cfg, section_name)
        if not dataclasses.is_dataclass(section):
            continue
        for name, hint in typing.get_type_hints(type(section)).items():
            allowed, value, dotted = choices(hint), getattr(section, name), f"{section_name}.{name}"
            if allowed is None or value in allowed:
                continue
            shown = ", ".join("null" if a is None else a for a in allowed)
            raise ConfigError(f"{dotted} must be one of {shown}, got {value!r}")


def _check_counts(cfg: Config) -> None:
    """Shapes, step counts and intervals: positive, and consistent with each other."""
    d, data = cfg.drafter, cfg.data
    if d.block_size < 2:
        raise ConfigError("drafter.block_size must be at least 2")
    if data.max_length is not None and data.max_length < d.block_size + 1:
        raise ConfigError("data.max_length must exceed drafter.block_size")
    positive = [
        ("run", "steps"),
        ("run", "log_every"),
        ("run", "eval_every"),
        ("run", "eval_batches"),
        ("run", "checkpoint_every"),
        ("data", "batch_size"),
        ("data", "anchors_per_seq"),
        ("drafter", "num_layers"),
    ]
    for section, name in positive:
        value = getattr(getattr(cfg, section), name)
        if value is not None and value < 1:  # None: decided from the target (recipe.py)
            raise ConfigError(f"{section}.{name} must be positive")
    if data.source == "jsonl" and not data.train_path:
        raise ConfigError("data.source jsonl needs data.train_path")


def _check_run(cfg: Config) -> None:
    """The run section's devices, timeouts, debug faults and compile pairing."""
    run = cfg.run
    if run.spec_prompts < 0 or run.spec_new_tokens < 1:
        raise ConfigError("run.spec_prompts must be >= 0 and run.spec_new_tokens >= 1")
    if run.threads < 0:
        raise ConfigError("run.threads must be >= 0")
    if run.gpus and run.threads not in (0, len(run.gpus)):
        raise ConfigError(f"run.threads {run.threads} contradicts run.gpus {run.gpus} (one thread per GPU)")
    if any(g < 0 for g in run.gpus) or len(set(run.gpus)) != len(run.gpus):
        raise ConfigError(f"run.gpus must list distinct GPU indices, got {run.gpus}")
    seconds = [
        ("run", "barrier_timeout_s"),
        ("run", "compile_timeout_s"),
        ("run", "warmup_timeout_s"),
        ("dist", "timeout_s"),
        ("dist", "rendezvous_timeout_s"),
        ("dist", "heartbeat_s"),
        ("dist", "lost_after_s"),
    ]
    for section, name in seconds:
        # Finite too: an infinite timeout overflows in threading and torch.distributed; nan compares false.
        value = getattr(getattr(cfg, section), name)
        if not 0 < value < math.inf:
            raise ConfigError(f"{section}.{name} must be a positive number of seconds, got {value!r}")
    if cfg.dist.lost_after_s <= cfg.dist.heartbeat_s:
        raise ConfigError(
            f"dist.lost_after_s {cfg.dist.lost_after_s:g} must exceed dist.heartbeat_s {cfg.dist.heartbeat_s:g}"
        )
    for name in ("fail_at", "hang_at", "stop_at"):
        spec = getattr(cfg.debug, name)
        if spec is not None and parse_fault_site(spec) is None:
            raise ConfigError(f"debug.{name} must be build, compile or step:K (K >= 1), got {spec!r}")
    if run.compile == "cudagraphs" and run.compile_scope == "layers":
        # The one place this pair is refused. One compiled layer serves every layer with other
        # parameters: the tree-less CUDA graph path assumes fixed parameter addresses per graph
        # (docs/threaded-compile.md); scope auto never picks layers under cudagraphs.
        raise ConfigError("run.compile_scope layers cannot use run.compile cudagraphs (use step)")
    if cfg.debug.fail_rank < 0:
        raise ConfigError("debug.fail_rank must be >= 0")
    if cfg.debug.fail_checkpoint is not None and cfg.debug.fail_checkpoint < 1:
        raise ConfigError("debug.fail_checkpoint must be a step >= 1")


def parse_fault_site(spec: str) -> str | None:
    """'build', 'compile' or 'step:K' (K >= 1) in canonical form; None when malformed."""
    if spec in ("build", "compile"):
        return spec
    kind, _, k = spec.partition(":")
    if kind != "step" or not k.strip().isdigit() or int(k) < 1:
        return None
    return f"step:{int(k)}"


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _apply_dict(obj: Any, data: dict[str, Any], prefix: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping")
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in _field_names(obj):
            raise ConfigError(f"unknown config key {dotted!r} (keys here: {', '.join(_field_names(obj))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply_dict(current, value, dotted + ".")
        else:
            setattr(obj, key, _coerce(value, typing.get_type_hints(type(obj))[key], dotted))


def _coerce(value: Any, hint: Any, dotted: str) -> Any:
    """Coerce a YAML value to a field's annotated type, or raise a one-line ConfigError."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict:  # a mapping field (target.rope_scaling) takes a YAML mapping as is
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted} must be a mapping, got {value!r}")
        return value
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], dotted)
    if typing.get_origin(hint) is Literal:
        hint = str  # the choice itself is checked by `validate`, which names the allowed values
    if typing.get_origin(hint) is list:
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            value = [value] if isinstance(value, int) else yaml.safe_load(f"[{value}]")
        if not isinstance(value, list):
            raise ConfigError(f"{dotted} must be a list, got {value!r}")
        return [_coerce(v, args[0], dotted) for v in value]
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if isinstance(value, bool):
                # YAML 1.1 reads a bare `off`/`on` (e.g. `compile: off`) as a boolean.
                return "on" if value else "off"
            if value is None or isinstance(value, (dict, list)):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"{dotted}: unsupported type {hint}")
    raise ConfigError(f"{dotted} must be {getattr(hint, '__name__', hint)}, got {value!r}")


# --- the config file, read strictly ---------------------------------------------------------------
# Here, not in a module of its own: dflashctl loads this file alone, by path (trainer_config.py).

_MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base` exists to be overridden by the keys after it


class _DuplicateKey(yaml.MarkedYAMLError):
    """A mapping that gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping's repeated key (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping, once its own keys, as written (before merges are flattened in), are distinct."""
        first: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            seen = first.get((key.tag, key.value))
            if seen is not None:
                problem = f"duplicate key '{key.value}' (first on line {seen})"
                raise _DuplicateKey(problem=problem, problem_mark=key.start_mark)
            first[(key.tag, key.value)] = key.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str) -> Any:
    """The YAML file at `path`; ConfigError `config PATH: line L, column C: PROBLEM` for bad UTF-8,
    a key given twice at any depth or bad YAML."""
    label = f"config {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {label}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = data.count(b"\n", 0, exc.start) + 1, exc.start - data.rfind(b"\n", 0, exc.start)
        raise ConfigError(
            f"{label}: line {line}, column {column}: not UTF-8 text (byte 0x{data[exc.start]:02x})"
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ConfigError(f"{label}:{where} {exc.problem or exc.context or 'invalid YAML'}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label}: {str(exc).splitlines()[0]}") from None
