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
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from userpath import ROOT, output_tokens, write_random_prompts


def main(argv: list[str] | None = None) -> int:
    """Push, regenerate, report; 1 if a command failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "regen_out")
    ap.add_argument("--work", default="/tmp/dflash-regen-bench")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset: check the script itself")
    args = ap.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)  # a scratch workdir: the output name must be free
    work.mkdir(parents=True)
    preset, vocab, rows, new, batch = ("tiny", 511, 16, 16, 4) if args.dry_run else ("qwen3-8b", 151600, 256, 512, 64)
    inventory = work / "hosts.yaml"
    inventory.write_text(
        f"default: local\nhosts:\n  local:\n    transport: local\n    workdir: {json.dumps(str(work / 'dflashctl'))}\n"
    )
    env = dict(os.environ, DFLASHCTL_INVENTORY=str(inventory), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    prompts = work / "bench-prompts.jsonl"
    write_random_prompts(prompts, rows, 8 if args.dry_run else 128, vocab)

    def cli(*cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dflashctl", *cmd],
            capture_output=True,
            text=True,
            env=env,
            cwd=work,
            timeout=timeout,
        )

    pushed = cli("data", "push", "local", str(prompts), timeout=120)
    if pushed.returncode != 0:
        print(f"push failed ({pushed.returncode}): {pushed.stderr[-500:]}")
        return 1
    t0 = time.perf_counter()
    regen = cli(
        "data",
        "regen",
        "local",
        "--prompts",
        prompts.name,
        "--out",
        "bench-regen",
        "--preset",
        preset,
        "--batch-size",
        str(batch),
        "--max-new-tokens",
        str(new),
        *(["--gpus", "cpu"] if args.dry_run else []),
        "--follow",
        timeout=1200,
    )
    wall = time.perf_counter() - t0
    (out / "regen_bench.txt").write_text(regen.stdout + regen.stderr)
    run = re.search(r"started regen run (\S+)", regen.stderr)
    if regen.returncode != 0 or not run:
        print(f"regen failed ({regen.returncode}): {regen.stderr[-800:]}")
        return 1
    metrics = work / "dflashctl" / "runs" / run.group(1) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = next((r.get("tokens_per_s") for r in reversed(records) if r.get("tokens_per_s")), None)
    tokens = output_tokens(work / "dflashctl" / "data" / "bench-regen.jsonl")
    row = {
        "preset": preset,
        "rows": rows,
        "batch": batch,
        "max_new_tokens": new,
        "output_tokens": tokens,
        "wall_s": round(wall, 1),
        "whole_command_tokens_per_s": round(tokens / wall, 1),
        "last_progress_tokens_per_s": steady,
    }
    print("ROW " + json.dumps(row), flush=True)
    (out / "regen_bench.json").write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
