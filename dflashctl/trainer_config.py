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
_LOADED_AS = "_dflashctl_payload_config"  # a private name: never the payload's own package


def load_module(source: Path) -> ModuleType | None:
    """The payload's config module, or None when the payload has none that this machine can
    load (another trainer, or one whose config needs a module not installed here)."""
    path = source / CONFIG_MODULE
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(_LOADED_AS, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_LOADED_AS] = module  # dataclasses and get_type_hints look their module up here
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    except Exception as exc:  # a broken payload: say so in one line rather than push it
        raise UsageError(f"cannot load the trainer's config code {path}: {type(exc).__name__}: {exc}") from None
    needed = ("load_config", "to_dict", "ConfigError")
    return module if all(hasattr(module, name) for name in needed) else None


def check_config(
    source: Path, config_file: Path | None, preset: str | None, overrides: Sequence[str]
) -> dict[str, Any] | None:
    """The config the trainer in `source` resolves from these options, as plain dicts (UsageError,
    naming the key, if it refuses them); None when `source` has no config code to ask, so the
    trainer's pre-flight in the container is the check."""
    module = load_module(source)
    if module is None:
        return None
    try:
        cfg = module.load_config(str(config_file) if config_file else None, preset, list(overrides))
    except module.ConfigError as exc:
        raise UsageError(f"trainer config: {exc}") from None
    return module.to_dict(cfg)
