"""GPU check of `dflash_train.regen`'s builtin engine (by hand on a CUDA machine, from the repo root):

    python3 tests/payload/gpu_regen_check.py [--gpus auto|0,1] [--dry-run]

1. greedy, the tiny target in fp32 on the GPUs (one worker each), batches of mixed prompt
   lengths with a failing row: how many output rows equal decode.greedy of that prompt alone
   (batch 1) on the first GPU (float noise between batch shapes may flip a near-tie);
2. sampled: two uninterrupted runs, and a run resumed from a torn partial, must be byte-identical;
3. the qwen3-8b shape (random bf16 weights), batch 16 x 64 new tokens: the decoder warm-up and the
   log's tok/s (a smoke test of the multi-worker path, not the throughput benchmark).
--dry-run does 1 and 2 on CPU (one worker) and skips 3.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_payload"))

from dflash_train import regen  # noqa: E402
from dflash_train.config import TargetConfig  # noqa: E402
from dflash_train.decode import greedy  # noqa: E402
from dflash_train.target import build_random_target  # noqa: E402


def prompts(n: int, vocab: int) -> list[dict]:
    """n token prompts of 3-40 tokens."""
    return [{"input_ids": [(5 + i * 37 + j * 11) % (vocab - 1) for j in range(3 + (i * 7) % 38)]} for i in range(n)]


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def check_greedy(tmp: Path, gpus: str, device: str) -> None:
    rows = prompts(40, 512)
    src = write(tmp / "p.jsonl", rows[:20] + ["not json"] + rows[20:])
    out = tmp / "greedy.jsonl"
    assert (
        regen.main(
            [
                "--prompts",
                str(src),
                "--out",
                str(out),
                "--gpus",
                gpus,
                "--set",
                "run.dtype=fp32",
                "--max-new-tokens",
                "32",
                "--batch-size",
                "8",
            ]
        )
        == 0
    )
    got = [json.loads(line) for line in out.read_text().splitlines()]
    target = build_random_target(TargetConfig(), 0, None, device, torch.float32)
    same = sum(
        r["input_ids"][len(p["input_ids"]) :] == greedy(target, p["input_ids"], 32, graphs=device != "cpu")
        for r, p in zip(got, rows)
    )
    print(f"greedy: {same}/{len(rows)} rows equal the batch-1 greedy decode on {device}", flush=True)


def check_exact(tmp: Path, gpus: str) -> None:
    src = write(tmp / "s.jsonl", prompts(30, 512))
    opts = [
        "--prompts",
        str(src),
        "--gpus",
        gpus,
        "--max-new-tokens",
        "24",
        "--batch-size",
        "4",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    ]
    files = []
    for name in ("a", "b"):
        assert regen.main([*opts, "--out", str(tmp / f"{name}.jsonl")]) == 0
        files.append((tmp / f"{name}.jsonl").read_bytes())
    lines = files[0].decode().splitlines(keepends=True)
    (tmp / ".c.jsonl.partial").write_text("".join(lines[:9]) + lines[9][:10])
    assert regen.main([*opts, "--out", str(tmp / "c.jsonl"), "--resume"]) == 0
    files.append((tmp / "c.jsonl").read_bytes())
    print(f"sampled: two runs identical {files[0] == files[1]}, resumed identical {files[0] == files[2]}", flush=True)


def check_8b(tmp: Path, gpus: str) -> None:
    src = write(tmp / "b.jsonl", prompts(64, 151936))
    t0 = time.perf_counter()
    assert (
        regen.main(
            [
                "--prompts",
                str(src),
                "--out",
                str(tmp / "8b.jsonl"),
                "--gpus",
                gpus,
                "--preset",
                "qwen3-8b",
                "--max-new-tokens",
                "64",
                "--batch-size",
                "16",
            ]
        )
        == 0
    )
    print(f"8b: {time.perf_counter() - t0:.1f} s in all (target builds, warm-up, 64 rows)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="auto")
    ap.add_argument("--dry-run", action="store_true", help="CPU only; skips the 8B part")
    args = ap.parse_args()
    gpus, device = (
        ("cpu", "cpu")
        if args.dry_run
        else (args.gpus, "cuda:0" if args.gpus == "auto" else f"cuda:{args.gpus.split(',')[0]}")
    )
    print(f"torch {torch.__version__} on {device}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        check_greedy(Path(tmp), gpus, device)
        check_exact(Path(tmp), gpus)
        if not args.dry_run:
            check_8b(Path(tmp), gpus)


if __name__ == "__main__":
    main()
