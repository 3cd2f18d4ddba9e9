"""Where `dflashctl data regen`'s built-in engine runs and on what target, planned without
importing torch (its pre-flight answers before anything is built; plan.py's device rule).
"""

from __future__ import annotations

from .config import Config, ConfigError, load_config
from .plan import DevicePlan, plan_devices
from .regen_rows import RegenError
from .target_config import resolve_target_config

# run.gpus/run.device: a pre-flight pin; run.bytecode_cache_dir: dflashctl's, as for a training run
ALLOWED_SETS = ("target.", "run.dtype=", "run.cpu_threads=", "run.gpus=", "run.device=", "run.bytecode_cache_dir=")


def resolve_target(
    preset: str | None, overrides: list[str], gpus: str, cuda_count: int | None = None
) -> tuple[Config, DevicePlan]:
    """(config with the target and dtype resolved, the worker devices as the run plan resolves
    them) for `--preset`, `--set target.*|run.dtype|run.cpu_threads` (and the pre-flight's pin,
    `run.gpus`/`run.device`) and `--gpus auto|cpu|0,1` (RegenError if bad); `cuda_count`: the
    visible GPUs (default: what torch sees)."""
    bad = [o for o in overrides if not o.startswith(ALLOWED_SETS)]
    if bad:
        raise RegenError(f"--set {bad[0]!r}: regen takes target.*, run.dtype and run.cpu_threads")
    pinned = [o for o in overrides if o.startswith(("run.gpus=", "run.device="))]
    if pinned and gpus != "auto":
        raise RegenError(f"--gpus {gpus} and --set {pinned[0]}: choose the devices once")
    if gpus == "cpu":
        overrides = ["run.device=cpu", *overrides]
    elif gpus != "auto":
        items = [t.strip() for t in gpus.split(",")]
        if not all(t.isdigit() for t in items) or len(set(items)) != len(items):
            raise RegenError(f"--gpus must be auto, cpu or distinct GPU indices like 0,1, got {gpus!r}")
        overrides = [f"run.gpus=[{','.join(items)}]", *overrides]
    try:
        cfg = load_config(None, preset, overrides)
        cfg.run.threads = 0  # one worker per GPU, one on CPU
        devices = plan_devices(cfg.run, cuda_count)
        cfg.target = resolve_target_config(cfg.target)
    except ConfigError as exc:
        raise RegenError(str(exc)) from None
    except (OSError, KeyError, ValueError) as exc:
        raise RegenError(f"target.path: {exc}") from None
    if cfg.run.dtype == "auto":
        cfg.run.dtype = "bf16" if devices.type == "cuda" else "fp32"
    return cfg, devices
