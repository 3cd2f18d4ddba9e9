"""`python -m dflash_train [--config run.yaml] [--preset NAME] [--set a.b=c ...] [--resume] [--preflight]`.

Exit codes: 0 done, 1 a worker failed, 2 a bad config or data, 4 a module the trainer needs is
missing, 128+N stopped by signal N (143: SIGTERM). `--preflight` resolves the run plan (plan.py)
without building anything and prints one JSON line: {"ok": true, "holds": ["0", "1"] | ["cpu"],
"pin": [argv pinning a run to them], "devices": [...], "summary": [...], "plan": {...}} or
{"ok": false, "error": "config"|"missing_module", "message": ...}.
"""

from __future__ import annotations

import time

LAUNCHED_AT = time.monotonic()  # before the imports below: the time to first step counts them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

EXIT_CONFIG, EXIT_MISSING = 2, 4


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, train (or pre-flight), return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m dflash_train", description="Train a DFlash drafter.")
    parser.add_argument("--config", help="YAML run config (may name a `preset:`)")
    parser.add_argument("--preset", help="base preset (default: tiny; real-target with target.path; config.PRESETS)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. run.steps=100 (repeatable)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="start over in an output dir with checkpoints")
    parser.add_argument(
        "--preflight", action="store_true", help="check the config and devices, print one JSON line, start nothing"
    )
    args = parser.parse_args(argv)
    try:
        # Imported here so that `--help` does not pay for importing torch.
        from .config import ConfigError, load_config
    except ImportError as exc:
        return _missing(exc, args.preflight)
    try:
        cfg = load_config(args.config, args.preset, args.overrides)
        from .bytecode import keep_bytecode

        kept = keep_bytecode(cfg.run.bytecode_cache_dir)  # before anything imports torch
        if args.preflight:
            return _preflight(cfg)
        if kept:
            print(kept, flush=True)
        from .checkpoint import StopFlag
        from .train import run_training
        from .workers import WorkerError, live_workers

        stop = StopFlag()
        stop.install()
        # Only this run's workers decide the hard exit below: a caller that runs main() twice in one
        # process (the tests) may still hold an earlier run's abandoned ones.
        before = threading.enumerate()
        try:
            code = run_training(cfg, resume=args.resume, overwrite=args.overwrite, stop=stop, launched_at=LAUNCHED_AT)
        except WorkerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        if live_workers(before):
            # Workers still inside a compile (a failure or a stop before step 1): daemon threads that
            # cannot be interrupted, and whose finalizers must not run; leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except ConfigError as exc:
        if args.preflight:
            print(json.dumps({"ok": False, "error": "config", "message": str(exc)}), flush=True)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ImportError as exc:
        return _missing(exc, args.preflight)


def _preflight(cfg) -> int:
    """Plan the run as a run would (ConfigError if it cannot), print the JSON answer."""
    from .plan import preflight_answer, resolve_run
    from .resolve import check_data_paths

    if cfg.run.tensorboard:  # stop here, one line, rather than after the model is built
        from .dashboard import require

        require()
    plan = resolve_run(cfg)
    check_data_paths(plan.cfg)
    print(json.dumps(preflight_answer(plan.devices, plan.summary(), plan.to_json())), flush=True)
    return 0


def _missing(exc: ImportError, preflight: bool) -> int:
    """A module the trainer needs is not installed in this interpreter: one line, exit 4."""
    name = getattr(exc, "name", None) or str(exc)
    package = {"yaml": "pyyaml"}.get(name, name)  # what pip installs it as
    needs = (
        "run.tensorboard needs it" if name == "tensorboard" else "the trainer needs torch, safetensors, numpy, pyyaml"
    )
    message = f"{package} is not installed in {sys.executable} ({needs})"
    if preflight:
        print(json.dumps({"ok": False, "error": "missing_module", "module": name, "message": message}), flush=True)
    else:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_MISSING


if __name__ == "__main__":
    from .fast_exit import exit_now
    from .lines import whole_lines

    whole_lines()
    exit_now(main())
