"""`python -m dflash_train.evaluate RUN_DIR [--prompts FILE|-] [--max-new-tokens N] [--count K]
[--prompts-name NAME] [--temperature T] [--seed S] [--no-baseline] [--report NAME]`: a finished run's exported drafter
against its target, by real speculative decoding (greedy by default), beside the free baseline.

For each prompt it times the target alone (KV-cached greedy decode) and the speculative loop,
checks (greedy) that both produced the same tokens (or, where they part, that the target's two
candidates there are a numerical tie: `first_difference`), and reports tau (tokens per verify step, the bonus
included; pooled over all steps and the mean of per-prompt tau), acceptance per draft position,
ms per output token of each and the speedup, and the cost of one verify step (draft + verify +
accept) in target decode steps. Greedy, unless --no-baseline, each prompt is also decoded by
prompt lookup (lookup.py: proposals copied from the text itself, verified on the same path),
checked the same way, with its tau and speedup and the drafter's ratios to them. The
report goes to RUN_DIR/eval.json (--report NAME: RUN_DIR/NAME) and, as one JSON line, to stdout;
progress lines go to stderr.
Exit codes: 0 done (also when the outputs differed: the report says so), 2 bad input (no
export yet, no or empty prompts, a prompt too long for the target's context), 4 torch missing.

Prompts: JSON lines with `input_ids` (token ids), `messages` (a chat, answered after its last
user turn through the run's tokenizer and chat template) or `prompt` (text); without --prompts,
the run's held-out split (the tokens before each sequence's first supervised token). The report's
`prompts_source` says which: {"from", "file" (--prompts-name for stdin), "rows", "sha256" of its
bytes}, file, rows and sha256 null for generated (demo, random) data.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import time
from pathlib import Path

from .bytecode import keep_bytecode_saying

USAGE_PREFIX = "eval error: "


class EvalError(ValueError):
    """Bad input for the evaluation: one line for the user."""


def tie_tolerance(dtype, magnitude: float) -> float:
    """The logit gap below which two decode paths may legitimately pick different tokens, for
    logits of `magnitude`: a block of B tokens per forward and one token per forward round
    differently. In bf16 that is 4 ulps at the logits' magnitude (0.25 up to |logit| 8, 0.5 at 16:
    each path's logit carries its own final rounding on top of what the layers compounded); in
    fp32 1e-4, where the CPU tests demand exact identity."""
    import torch

    return 1e-4 if dtype == torch.float32 else 2.0**-5 * max(abs(magnitude), 8.0)


def first_difference(target, prompt: list[int], reference: list[int], tokens: list[int]) -> dict | None:
    """Where the speculative output first departs from the greedy reference (None: identical),
    with the target's two logits there from one full forward: a gap within `tie_tolerance` is a
    numerical tie, a larger one a bug."""
    import torch

    j = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if j is None:
        return (
            None
            if len(reference) == len(tokens)
            else {"index": min(len(reference), len(tokens)), "logit_gap": None, "tie": False}
        )
    device = target.embed_tokens.weight.device
    logits = target.logits(torch.tensor([prompt + reference[:j]], device=device))[0, -1]
    ours, theirs = float(logits[reference[j]]), float(logits[tokens[j]])
    gap = abs(ours - theirs)
    return {
        "index": j,
        "reference": reference[j],
        "speculative": tokens[j],
        "reference_logit": ours,
        "speculative_logit": theirs,
        "logit_gap": gap,
        "tie": gap <= tie_tolerance(target.embed_tokens.weight.dtype, max(abs(ours), abs(theirs))),
    }


def evaluate_run(
    run_dir: Path,
    prompts: list[dict] | None,
    max_new_tokens: int,
    count: int,
    device: str | None,
    temperature: float = 0.0,
    seed: int = 0,
    progress=lambda line: None,
    baseline: bool = True,
    source: dict | None = None,
) -> dict:
    """Decode each prompt with the target alone and speculatively (and, greedy with `baseline`, by
    prompt lookup); the report (see the module doc). At temperature 0 the outputs must be
    identical; sampled, they are not compared (the speculative-sampling rule keeps the target's
    distribution, tested statistically). `source`: where `prompts` came from (`prompts_source`;
    None: the run's own, `run_prompts_source`)."""
    import torch

    from .decode import greedy, make_decoder
    from .export import load_exported
    from .lookup import lookup_decode
    from .replica import build_target
    from .speculate import DraftDecoder, decode_room, speculate

    export = run_dir / "export"
    if not (export / "model.safetensors").is_file():
        # dflashctl knows the run's state and words this line from it (evaluation.py's NO_EXPORT).
        raise EvalError(f"no export in {run_dir} (a run writes one at its last step)")
    cfg, dev, prompts = eval_plan(run_dir, prompts, max_new_tokens, count, device)
    target = build_target(cfg, dev).eval()
    drafter, _ = load_exported(export, dev)
    # In the target's dtype, as a server loads it (bf16 on a GPU): no fp32 weights cast per call.
    drafter = drafter.to(target.embed_tokens.weight.dtype).eval()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=dev).manual_seed(seed)
    # One decoder for every prompt and both loops: its compiled steps and CUDA graphs are made
    # once, in a warm-up decode of the first prompt that the timings leave out.
    room = decode_room(max(map(len, prompts)), max_new_tokens, cfg.drafter.block_size)
    decoder = make_decoder(target, 1, room, cfg.drafter.target_layer_ids)
    drafting = DraftDecoder(drafter, target, room)
    progress("warm-up decode (compiles the decode steps and captures their CUDA graphs on a GPU)")
    greedy(target, prompts[0], max_new_tokens, decoder=decoder)
    speculate(target, drafter, prompts[0], max_new_tokens, verifier=decoder, drafting=drafting)
    # The baseline proposes as many tokens as the drafter drafts: its verify step is the drafter's.
    lookup_tokens = cfg.drafter.block_size - 1 if baseline and temperature == 0 else 0
    if lookup_tokens:
        lookup_decode(target, prompts[0], max_new_tokens, lookup_tokens, decoder=decoder)
    rows, results, lookups, lookup_rows = [], [], [], []
    for i, prompt in enumerate(prompts):
        row, spec, lookup, lookup_row = decode_prompt(
            target, drafter, prompt, max_new_tokens, temperature, generator, decoder, drafting, lookup_tokens, sync
        )
        rows.append(row)
        results.append(spec)
        if lookup is not None:
            lookups.append(lookup)
            lookup_rows.append(lookup_row)
        same = "" if temperature else f", identical {row['identical']}"
        versus = f", prompt lookup tau {lookup.tau:.2f}" if lookup is not None else ""
        progress(f"prompt {i + 1}/{len(prompts)}: tau {spec.tau:.2f}{same}{versus}")
    report = {
        "schema": "dflashctl.eval/1",
        "run_dir": str(run_dir),
        "device": str(dev),
        "prompts": len(rows),
        "prompts_source": source or run_prompts_source(cfg),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "block_size": cfg.drafter.block_size,
    }
    return {
        **report,
        **decode_figures(rows, results, cfg.drafter.block_size, temperature, lookups, lookup_rows, lookup_tokens),
    }


def prompts_source(what: str, name: str | None, raw: bytes | None = None) -> dict:
    """eval.json's `prompts_source`: where the prompts came from (`what`), the file (`name`; None
    for generated data), its rows (non-blank lines) and the sha256 of its bytes (`raw`, else the
    file's, read in a stream: a held-out split's file is the whole training set)."""
    if name is None:
        return {"from": what, "file": None, "rows": None, "sha256": None}
    digest, rows = hashlib.sha256(), 0
    with contextlib.nullcontext(io.BytesIO(raw)) if raw is not None else open(name, "rb") as lines:
        for line in lines:  # lines end at b"\n" alone, as the prompts reader's do
            digest.update(line)
            rows += bool(line.strip())
    return {"from": what, "file": name, "rows": rows, "sha256": digest.hexdigest()}


def run_prompts_source(cfg) -> dict:
    """Where the run's own prompts (`train.spec_prompts`: eval without --prompts) come from."""
    d = cfg.data
    if d.spec_prompts_path:
        return prompts_source("data.spec_prompts_path", d.spec_prompts_path)
    if d.source == "jsonl" and d.eval_path:
        return prompts_source("the held-out data.eval_path", d.eval_path)
    if d.source == "jsonl":
        return prompts_source(f"the held-out split ({d.eval_fraction:g}) of data.train_path", d.train_path)
    return prompts_source(f"the held-out split of the {d.source} data (seed {cfg.run.seed})", None)


def eval_plan(run_dir: Path, prompts: list[dict] | None, max_new_tokens: int, count: int, device: str | None) -> tuple:
    """(the run's config planned for this machine, the device, the prompts as token ids), the
    prompts checked against the target before it is built (16 GB at 8B scale)."""
    import torch

    from .config import load_config
    from .data import encode_prompt_rows
    from .plan import resolve_run
    from .train import spec_prompts
    from .workers import use_cpu_threads

    overrides = [f"run.spec_prompts={max(count, 1)}"] + ([f"run.device={device}", "run.gpus=[]"] if device else [])
    plan = resolve_run(load_config(str(run_dir / "config.resolved.yaml"), overrides=overrides))
    cfg = plan.cfg
    use_cpu_threads(cfg.run.cpu_threads)  # the run's own setting, as its trainer applied it
    if prompts is None:
        prompts = spec_prompts(cfg)  # at most run.spec_prompts = count of them
        if not prompts:
            raise EvalError("the run's held-out split gives no prompts: pass --prompts FILE.jsonl")
    else:
        prompts = encode_prompt_rows(prompts[:count], cfg.data.tokenizer_path or cfg.target.path, cfg.target.vocab_size)
    limit = cfg.target.max_position_embeddings
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens + cfg.drafter.block_size > limit:
            raise EvalError(
                f"prompt {i + 1} has {len(prompt)} tokens: with {max_new_tokens} new ones it exceeds "
                f"the target's context of {limit}"
            )
        if max(prompt) >= cfg.target.vocab_size:
            raise EvalError(f"prompt {i + 1} has a token id beyond the target's vocabulary ({cfg.target.vocab_size})")
    return cfg, torch.device(plan.devices.workers[0]), prompts  # the decoding is one process on one device


def decode_prompt(
    target,
    drafter,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    generator,
    decoder,
    drafting,
    lookup_tokens: int,
    sync,
) -> tuple:
    """One prompt decoded by the target, speculatively and (lookup_tokens > 0) by prompt lookup,
    each timed: (its row, the speculative result, the lookup result or None, the lookup's row or None)."""
    from .decode import greedy
    from .lookup import lookup_decode
    from .speculate import speculate

    sync()
    t0 = time.perf_counter()
    reference = greedy(target, prompt, max_new_tokens, decoder=decoder)
    sync()
    t1 = time.perf_counter()
    spec = speculate(
        target,
        drafter,
        prompt,
        max_new_tokens,
        temperature=temperature,
        generator=generator,
        verifier=decoder,
        drafting=drafting,
    )
    sync()
    t2 = time.perf_counter()
    lookup = lookup_row = None
    if lookup_tokens:
        lookup = lookup_decode(target, prompt, max_new_tokens, lookup_tokens, decoder=decoder)
        sync()
        lookup_ms = 1e3 * (time.perf_counter() - t2) / len(lookup.tokens)
        differs = first_difference(target, prompt, reference, lookup.tokens)
        lookup_row = {
            "tau": lookup.tau,
            "identical": differs is None,
            "first_difference": differs,
            "ms_per_token": lookup_ms,
            "new_tokens": len(lookup.tokens),
            "verify_steps": len(lookup.accepted),
        }
    differs = first_difference(target, prompt, reference, spec.tokens) if temperature == 0 else None
    row = {
        "prompt_tokens": len(prompt),
        "new_tokens": len(spec.tokens),
        "tau": spec.tau,
        "identical": differs is None if temperature == 0 else None,
        "first_difference": differs,
        "target_ms_per_token": 1e3 * (t1 - t0) / len(reference),
        "spec_ms_per_token": 1e3 * (t2 - t1) / len(spec.tokens),
        "verify_steps": len(spec.accepted),
    }
    return row, spec, lookup, lookup_row


def decode_figures(
    rows: list[dict],
    results: list,
    block_size: int,
    temperature: float,
    lookups: list,
    lookup_rows: list[dict],
    lookup_tokens: int,
) -> dict:
    """The report's figures over every prompt: tau, speed, identity, and the prompt-lookup baseline."""
    from .speculate import acceptance_by_position, tau_figures

    steps = sum(len(r.accepted) for r in results)
    tau, tau_prompt_mean = tau_figures(results)
    tokens = sum(r["new_tokens"] for r in rows)
    target_ms = sum(r["target_ms_per_token"] * r["new_tokens"] for r in rows) / tokens
    spec_ms = sum(r["spec_ms_per_token"] * r["new_tokens"] for r in rows) / tokens
    # A verify step's whole cost (draft, verify, accept) in target decode steps: speedup = tau / this.
    step_ms = sum(r["spec_ms_per_token"] * r["new_tokens"] for r in rows) / max(steps, 1)
    report = {
        "tau": tau,
        "tau_prompt_mean": tau_prompt_mean,
        "acceptance_by_position": acceptance_by_position(results, block_size),
        "target_ms_per_token": target_ms,
        "spec_ms_per_token": spec_ms,
        "speedup": target_ms / spec_ms,
        "spec_ms_per_step": step_ms,
        "step_cost": step_ms / target_ms,
        "identical": all(r["identical"] for r in rows) if temperature == 0 else None,
        "differences_are_ties": all(r["first_difference"]["tie"] for r in rows if r["first_difference"])
        if temperature == 0
        else None,
        "per_prompt": rows,
        "baseline": baseline_report(lookups, lookup_rows, lookup_tokens, target_ms) if lookups else None,
    }
    if lookups:  # above 1: the drafter beats what costs nothing
        free = report["baseline"]
        report["drafter_vs_baseline"] = {key: report[key] / free[key] for key in ("tau", "tau_prompt_mean", "speedup")}
    return report


def baseline_report(lookups: list, rows: list[dict], num_tokens: int, target_ms: float) -> dict:
    """eval.json's `baseline`: prompt lookup's figures over the prompts (its decodes and per-prompt
    rows), counted as the drafter's."""
    from .lookup import MAX_NGRAM
    from .speculate import tau_figures

    tau, tau_prompt_mean = tau_figures(lookups)
    ms = sum(r["ms_per_token"] * r["new_tokens"] for r in rows) / sum(r["new_tokens"] for r in rows)
    return {
        "method": "prompt lookup",
        "num_tokens": num_tokens,
        "max_ngram": MAX_NGRAM,
        "tau": tau,
        "tau_prompt_mean": tau_prompt_mean,
        "ms_per_token": ms,
        "speedup": target_ms / ms,
        "identical": all(r["identical"] for r in rows),
        "differences_are_ties": all(r["first_difference"]["tie"] for r in rows if r["first_difference"]),
        "per_prompt": rows,
    }


def run_bytecode_dir(run_dir: Path) -> str | None:
    """The run's `run.bytecode_cache_dir`, read without torch (None when the run's config cannot be
    read: the evaluation says why when it reads it)."""
    from .config import ConfigError, load_config

    try:
        return load_config(str(run_dir / "config.resolved.yaml")).run.bytecode_cache_dir
    except (ConfigError, OSError):
        return None


def given_prompts(path: str | None, name: str | None) -> tuple[list[dict] | None, dict | None]:
    """--prompts' rows (`-`: stdin) and their `prompts_source` (None, None: the run's own prompts)."""
    from .data import parse_prompt_rows

    if not path:
        return None, None
    raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    return parse_prompt_rows(raw), prompts_source("--prompts", name or ("stdin" if path == "-" else path), raw)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m dflash_train.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument(
        "--prompts", help="JSONL of input_ids, messages or prompt rows (- for stdin); default: held-out split"
    )
    ap.add_argument(
        "--prompts-name",
        metavar="NAME",
        help="the prompts file's name for the report (--prompts -: where it came from)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--count", type=int, default=16, help="at most this many prompts")
    ap.add_argument("--device", help="cpu, cuda:N (default: the run's device, else auto)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (lossless check); > 0: sampled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the prompt-lookup baseline (measured greedy only)",
    )
    ap.add_argument("--report", default="eval.json", help="the report's file name in RUN_DIR")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, evaluate, write eval.json, print the report line; see the module docstring."""
    args = parse_args(argv)

    def progress(line: str) -> None:
        print(f"eval: {line}", file=sys.stderr, flush=True)

    try:
        if args.max_new_tokens < 1 or args.count < 1:
            raise EvalError("--max-new-tokens and --count must be at least 1")
        if not 0 <= args.temperature < float("inf"):
            raise EvalError(f"--temperature must be 0 (greedy) or positive, got {args.temperature:g}")
        run_dir = Path(args.run_dir)
        keep_bytecode_saying(run_bytecode_dir(run_dir), progress)  # where the run's trainer kept it; before torch
        from .config import ConfigError
        from .data import DataError

        try:
            prompts, source = given_prompts(args.prompts, args.prompts_name)
            report = evaluate_run(
                run_dir,
                prompts,
                args.max_new_tokens,
                args.count,
                args.device,
                args.temperature,
                args.seed,
                progress,
                args.baseline,
                source,
            )
        except (ConfigError, DataError) as exc:  # DataError: a prompts file that cannot be read or encoded
            raise EvalError(str(exc)) from None
    except EvalError as exc:
        print(f"{USAGE_PREFIX}{exc}", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:
        print(f"{USAGE_PREFIX}{exc.filename or ''}: {exc.strerror}", file=sys.stderr, flush=True)
        return 2
    except ImportError as exc:
        print(f"eval missing module: {exc.name or exc}", file=sys.stderr, flush=True)
        return 4
    (run_dir / args.report).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    from .fast_exit import exit_now
    from .lines import whole_lines

    whole_lines()
    exit_now(main())
