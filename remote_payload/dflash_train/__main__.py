"""`python -m dflash_train [--config run.yaml] [--preset NAME] [--set a.b=c ...] [--resume]`."""

from __future__ import annotations

import argparse
import os
import sys

from .config import PRESETS, ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, train, return the exit code (2 for a bad config)."""
    parser = argparse.ArgumentParser(prog="python -m dflash_train", description="Train a DFlash drafter.")
    parser.add_argument("--config", help="YAML run config (may name a `preset:`)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="base preset (default: tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. run.steps=100 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="start over in an output dir with checkpoints")
    args = parser.parse_args(argv)

    # Imported here so that `--help` and config errors do not pay for importing torch.
    try:
        cfg = load_config(args.config, args.preset, args.overrides)
        from .checkpoint import StopFlag
        from .train import run_training

        from .workers import WorkerError

        stop = StopFlag()
        stop.install()
        try:
            return run_training(cfg, resume=args.resume, overwrite=args.overwrite, stop=stop)
        except WorkerError as exc:
            # The failing worker's traceback; the others were stopped (or are stuck in a compile:
            # they are daemon threads, and os._exit does not wait for them or run their finalizers).
            print(f"error: {exc}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
