"""`--preset`, `--config` and `--set` checked on this machine by the trainer's own config code
(`dflash_train/config.py` of the payload about to be pushed), so a typo is refused before
anything changes on the host. That module imports only the standard library and yaml; it is
loaded by path, without its package (whose other modules import torch)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from .errors import UsageError

CONFIG_MODULE = Path("dflash_train") / "config.py"
REGEN_OPTIONS_MODULE = Path("dflash_train") / "regen_options.py"


def load_module(source: Path, relative: Path = CONFIG_MODULE) -> ModuleType | None:
    """The payload's module at `relative` (its config code by default), or None when the payload
    has none that this machine can load (another trainer, or code that needs a module not
    installed here)."""
    path = source / relative
    if not path.is_file():
        return None
    loaded_as = "_dflashctl_payload_" + path.stem  # a private name: never the payload's own package
    spec = importlib.util.spec_from_file_location(loaded_as, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loaded_as] = module  # dataclasses and get_type_hints look their module up here
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    except Exception as exc:  # a broken payload: say so in one line rather than push it
        raise UsageError(f"cannot load the trainer's code {path}: {type(exc).__name__}: {exc}") from None
    return module


def check_config(
    source: Path, config_file: Path | None, preset: str | None, overrides: Sequence[str]
) -> dict[str, Any] | None:
    """The config the trainer in `source` resolves from these options, as plain dicts (UsageError,
    naming the key, if it refuses them); None when `source` has no config code to ask, so the
    trainer's pre-flight in the container is the check."""
    module = load_module(source)
    if module is None or not all(hasattr(module, name) for name in ("load_config", "to_dict", "ConfigError")):
        return None
    try:
        cfg = module.load_config(str(config_file) if config_file else None, preset, list(overrides))
    except module.ConfigError as exc:
        raise UsageError(f"trainer config: {exc}") from None
    resolved = module.to_dict(cfg)
    check_data_source(resolved.get("data") or {})
    return resolved


def check_data_source(data: dict[str, Any]) -> None:
    """A data file named while data.source reads none is a UsageError: the trainer would train on
    its demo or random sequences and ignore the file; so is a data regen's errors file (its failed
    rows, no training rows). Checked on the config the trainer's code resolved (`--set` and
    `--config` alike), since that code accepts it."""
    from .data import errors_of

    for key in ("train_path", "eval_path"):
        path = str(data.get(key) or "")
        name = path.rpartition("/")[2].removeprefix("data:")
        of = errors_of(name)
        if of:
            raise UsageError(
                f"trainer config: data.{key}={path} is the errors file of a data regen (the rows that failed, "
                f"{{index, reason}}), not a dataset: train on its output, {path[: len(path) - len(name)]}{of}"
            )
    if "source" not in data or data["source"] == "jsonl":  # another trainer's config, or one that reads files
        return
    for key in ("train_path", "eval_path"):
        if data.get(key):
            raise UsageError(
                f"trainer config: data.{key} is set but data.source is {data['source']}: add --set data.source=jsonl"
            )
