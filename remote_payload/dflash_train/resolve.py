"""Config resolution: the `auto`/None fields that follow from the target and the data, without
building a model, and the summary a run starts with. The machine's decisions (devices, compile,
launcher, captures) are the run plan's (plan.py), which calls `fill_config`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .config import Config, ConfigError
from .recipe import recipe_for_target
from .target_config import default_target_layer_ids, drafter_rope, resolve_mask_token_id, resolve_target_config

if TYPE_CHECKING:
    from .model import DrafterSpec

FULL, SLIDING = "full_attention", "sliding_attention"  # drafter.layer_types (sliding.py's masks)
DATASET_PREFIX = "data:"  # data.train_path: data:NAME is <data.dir>/NAME (`dflashctl data push`)


def fill_config(cfg: Config, notes: list[str]) -> None:
    """Fill in place what follows from the target and the data, not from the machine (target
    shape, recipe, feature layers, MASK id, dataset paths, gamma, export dir); ConfigError on
    inconsistencies. The machine's decisions are plan.resolve_run's, which calls this."""
    d = cfg.drafter
    cfg.target = resolve_target_config(cfg.target, notes)
    _fill_recipe(cfg, notes)
    if d.target_layer_ids is None:
        d.target_layer_ids = default_target_layer_ids(cfg.target.num_layers, d.num_target_features)
    if not d.target_layer_ids or not all(0 <= i < cfg.target.num_layers for i in d.target_layer_ids):
        raise ConfigError(f"drafter.target_layer_ids {d.target_layer_ids} must lie in [0, {cfg.target.num_layers - 1}]")
    try:
        d.mask_token_id = resolve_mask_token_id(cfg.target, d.mask_token_id, cfg.data.tokenizer_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_layer_types(d.layer_types, d.sliding_window, d.num_layers)
    for key in ("train_path", "eval_path", "spec_prompts_path"):
        path = getattr(cfg.data, key)
        if path is not None and path.startswith(DATASET_PREFIX):
            if cfg.data.dir is None:
                raise ConfigError(f"data.{key} {path}: a pushed dataset needs data.dir (dflashctl train sets it)")
            setattr(cfg.data, key, str(Path(cfg.data.dir) / path[len(DATASET_PREFIX) :]))
    if cfg.optim.gamma is None:
        cfg.optim.gamma = default_gamma(d.block_size)
    if cfg.run.export_dir is None:
        cfg.run.export_dir = str(Path(cfg.run.output_dir) / "export")


def default_gamma(block_size: int) -> float:
    """gamma for w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16, interpolated otherwise."""
    # The paper's three points (App. A.1) joined linearly: slope 1/2 below B=10, 1/3 above, floor 1.
    if block_size <= 10:
        return max(1.0, 5.0 + (block_size - 10) / 2)
    return 5.0 + (block_size - 10) / 3


def check_layer_types(layer_types: list[str] | None, sliding_window: int | None, num_layers: int) -> tuple[str, ...]:
    """The per-layer types of a drafter of `num_layers` layers (() when all are full); ConfigError
    if they do not fit."""
    if layer_types is None:
        return ()
    if len(layer_types) != num_layers:
        raise ConfigError(f"drafter.layer_types lists {len(layer_types)} layer(s) for a drafter of {num_layers}")
    bad = sorted(set(layer_types) - {FULL, SLIDING})
    if bad:
        raise ConfigError(f"drafter.layer_types: {bad[0]!r} is not {FULL} or {SLIDING}")
    if SLIDING in layer_types and (sliding_window is None or sliding_window < 1):
        raise ConfigError("drafter.layer_types has sliding_attention layers: set drafter.sliding_window (>= 1)")
    return () if SLIDING not in layer_types else tuple(layer_types)


def _fill_recipe(cfg: Config, notes: list[str]) -> None:
    """Fill the recipe fields left None (the real-target preset) from the target's size."""
    recipe = recipe_for_target(cfg.target.hidden_size)
    filled = []
    for section, name in (
        ("drafter", "num_layers"),
        ("data", "max_length"),
        ("data", "anchors_per_seq"),
        ("data", "batch_size"),
    ):
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
    "qwen3-8b": (
        "random weights on random tokens at Qwen3-8B's shape: measures speed and memory, never quality "
        "(tau is 1.0 by construction); train on your checkpoint with --set target.path=DIR"
    ),
    "llama3-8b": "random weights at Llama-3.1-8B's shape through transformers: speed and memory only",
    "qwen3-30b-a3b": "random weights at Qwen3-30B-A3B's shape (MoE) through transformers: speed and memory only",
}


def drafter_spec(cfg: Config) -> DrafterSpec:
    """The drafter's architecture from a resolved config."""
    from .model import DrafterSpec  # torch: not on the pre-flight's path
    from .target import shape_of

    d = cfg.drafter
    shape = dataclasses.replace(shape_of(cfg.target), rope_scaling=drafter_rope(cfg.target))
    return DrafterSpec(
        shape,
        d.num_layers,
        d.block_size,
        tuple(d.target_layer_ids),
        d.mask_token_id,
        check_layer_types(d.layer_types, d.sliding_window, d.num_layers),
        d.sliding_window,
    )


def check_data_paths(cfg: Config) -> None:
    """The data files the run reads exist and start with rows it can read (a pre-flight check; the
    rest is read at start): a jsonl run's train and eval files (token or chat rows), and any run's
    data.spec_prompts_path; chat and prompt rows need a tokenizer."""
    keys = ("train_path", "eval_path", "spec_prompts_path") if cfg.data.source == "jsonl" else ("spec_prompts_path",)
    tokenizer = cfg.data.tokenizer_path or cfg.target.path
    for key in keys:
        path = getattr(cfg.data, key)
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"data.{key}: no such file: {path}")
        line, kind = first_row_kind(Path(path))
        if key != "spec_prompts_path" and kind == "prompt":
            raise ConfigError(
                f"data.{key} {path}: line {line} is a prompt row; training reads token or chat rows: have the "
                f"target write the replies first (dflashctl data regen), or give it as data.spec_prompts_path"
            )
        if kind in ("messages", "prompt") and tokenizer is None:
            raise ConfigError(
                f"data.{key} {path}: line {line} is a {kind} row, which needs a tokenizer: set target.path "
                f"or data.tokenizer_path, or give input_ids rows"
            )


def first_row_kind(path: Path) -> tuple[int, str | None]:
    """(line number, kind: input_ids, messages or prompt) of a JSONL file's first non-blank line; a
    kind of None when it has none of them (the reader at start says exactly what is wrong)."""
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            if raw.strip():
                try:
                    row = json.loads(raw)
                except ValueError:
                    return number, None
                return number, next(
                    (k for k in ("input_ids", "messages", "prompt") if isinstance(row, dict) and k in row), None
                )
    return 0, None


def summary(cfg: Config, notes: list[str], n_params: int | None = None) -> list[str]:
    """The few lines a run starts with: model, data, devices, compile policy and why."""
    t, d, data, run = cfg.target, cfg.drafter, cfg.data, cfg.run
    target = t.path or (
        f"random {t.model_type} shape ({t.num_layers} layers, hidden {t.hidden_size}, vocab {t.vocab_size})"
    )
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
