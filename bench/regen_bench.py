"""`dflashctl data regen` as a user runs it, timed as a whole process (issue 16's speed section):
push prompts, regenerate them with the builtin engine on the 8B-shaped target, read the rate.

    python3 bench/regen_bench.py --out $OUT                 # one GPU: 256 prompts x 512 tokens, batch 64
    python3 bench/regen_bench.py --dry-run --out /tmp/rb    # CPU, tiny preset: checks the script

Prints one ROW: the whole command's wall time and output tokens/s (start-up, the target's build
and the decoder's warm-up included), and the steady rate of the run's last progress record.
decode_bench.py's `batch` stage is the same decode without the program around it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from userpath import LocalHostBench


def main(argv: list[str] | None = None) -> int:
    """Push, regenerate, report; 1 if a command failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "regen_out")
    ap.add_argument("--work", default="/tmp/dflash-regen-bench")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset: check the script itself")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = LocalHostBench(out, Path(args.work), "regen_bench.txt", budget_s=1300)  # a scratch workdir
    row = bench.regen_random("bench-regen", args.dry_run, 1200)
    bench.log("ROW " + json.dumps(row))
    (out / "regen_bench.json").write_text(json.dumps(row, indent=1))
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
