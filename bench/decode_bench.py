"""Decode speed of the payload's one KV-cached path (decode.py) on the 8B-shaped target, against
transformers' `generate` on the same weights, and the real train -> eval path (issues 15, 16).

    python3 bench/decode_bench.py --out $OUT                 # one GPU, ~4 minutes
    python3 bench/decode_bench.py --dry-run --out /tmp/dec   # CPU, tiny preset: checks the script

Stages (--stages, comma-separated; each prints a table row and goes into decode_bench.json):
  decode   target-only greedy decode at batch 1 (128-token prompt, 256 new tokens), CUDA graphs
           and eager, ms per output token against the weights' bandwidth floor
  hf       transformers' generate at batch 1 and 64, default and static cache (same weights)
  verify   one verify step (16 tokens after a 384-token cache) against one decode step
  profile  one batch-1 decode step's kernels (compiled layer parts launched without the graph, under
           torch.profiler): GPU time per step by kind (GEMM, attention, cache writes, fused Inductor
           kernels, other), the GEMMs' effective bandwidth, and the step's kernel time against the
           graph's ms/token (the rest is the gaps between kernels); then the same for one step of a
           regen batch (64 rows, 384 cached slots)
  inductor the batch-1 decode of the decode stage and the batch stage's regen batch with the layer
           parts compiled under other Inductor settings (programmatic dependent launch, coordinate-
           descent tuning, max-autotune): ms/token, tokens/s and the warm-up (compile) time of
           each, the default first and again last (the spread between them is the noise)
  batch    batched generation (what `data regen --engine builtin` runs): 64 prompts x 128 tokens,
           512 new, output tokens/s, and how much of it the prompts' (eager) prefill takes
  e2e      the user's path on the same random target: its greedy text of 128 prompts as JSONL
           (prompts masked), `dflashctl train local --preset qwen3-8b` on it, then
           `dflashctl eval local RUN`: tau, speedup and the verify step's cost
Results: docs/eval.md and docs/data.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "remote_payload"))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dflash_train.config import load_config  # noqa: E402
from dflash_train.decode import Decoder, generate  # noqa: E402
from dflash_train.replica import build_target  # noqa: E402
from dflash_train.target import hf_state_dict  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402


# Kernel names by kind, the first match wins: attention before GEMM, since cuDNN's and FlashAttention's
# kernel names carry sm90 too (cuBLAS on Hopper names its GEMMs nvjet_*; Inductor's kernels start triton_).
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|softmax", re.I)),
    ("cache write", re.compile(r"index_copy|indexfunc|index_put|scatter", re.I)),
    ("fused (Inductor)", re.compile(r"^triton_", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|cublas|splitk|xmma|sm90_|sm80_|aten::(mm|addmm|bmm|linear)$", re.I)),
)


def kind_of(name: str) -> str:
    """The kind of a kernel (or, on the CPU, an aten op) by its name."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_times(prof, device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of each GPU kernel the profiler saw; on the CPU each aten op's self time."""
    if device.type == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.name.startswith("aten::")]


class Bench:
    """The stages against one random target, built the way the trainer builds it."""

    def __init__(self, out: Path, dry: bool):
        self.out, self.dry = out, dry
        self.device = torch.device("cpu" if dry else "cuda:0")
        preset = "tiny" if dry else "qwen3-8b"
        self.preset = preset
        self.overrides = ["data.source=jsonl", "data.train_path=unused"]
        self.cfg = resolve_run(load_config(preset=preset, overrides=self.overrides + [f"run.device={self.device}"])).cfg
        self.target = build_target(self.cfg, self.device).eval()
        self.vocab = self.cfg.target.vocab_size
        self.rows: list[dict] = []
        self.sizes = (8, 16, 4, 8) if dry else (128, 256, 64, 512)  # prompt, new (batch 1), batch, new (batch)
        self.gen = torch.Generator().manual_seed(0)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn) -> tuple[float, object]:
        self.sync()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - t0, result

    def prompts(self, count: int, length: int) -> list[list[int]]:
        ids = torch.randint(0, self.vocab - 2, (count, length), generator=self.gen)
        return ids.tolist()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print("ROW " + json.dumps(row), flush=True)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every weight but the embedding table (only rows are gathered)."""
        params = {id(p): p for p in self.target.parameters()}
        embed = self.target.embed_tokens.weight
        skip = 0 if self.target.lm_head.weight is embed else embed.numel() * embed.element_size()
        return sum(p.numel() * p.element_size() for p in params.values()) - skip

    # -- stages ----------------------------------------------------------------------------

    def decode(self) -> None:
        prompt_len, new, _, _ = self.sizes
        prompt = self.prompts(1, prompt_len)
        floor_ms = 1e3 * self.weight_bytes() / 4.3e12
        for label, graphs in (("ours, CUDA graphs", None), ("ours, eager", False)):
            if self.dry and graphs is None:
                continue
            count = new if graphs is None else max(8, new // 4)
            decoder = Decoder(self.target, 1, prompt_len + count, graphs=graphs)
            generate(self.target, prompt, count, decoder=decoder)  # warm-up: compiles, captures the graphs
            times = [self.timed(lambda: generate(self.target, prompt, count, decoder=decoder))[0] for _ in range(3)]
            ms = 1e3 * statistics.median(times) / count
            self.add(
                {
                    "stage": "decode",
                    "row": label,
                    "batch": 1,
                    "new_tokens": count,
                    "ms_per_token": round(ms, 2),
                    "of_bandwidth": round(floor_ms / ms, 3),
                    "floor_ms": round(floor_ms, 2),
                }
            )
        self.reference = generate(self.target, prompt, 32)[0]
        self.reference_prompt = prompt

    def hf(self) -> None:
        try:
            import transformers
            from transformers import Qwen3Config, Qwen3ForCausalLM
        except ImportError as exc:
            self.add({"stage": "hf", "row": f"skipped: {exc}"})
            return
        t = self.cfg.target
        hf_cfg = Qwen3Config(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_layers,
            num_attention_heads=t.num_heads,
            num_key_value_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            rope_theta=t.rope_theta,
            rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_position_embeddings,
            tie_word_embeddings=t.tie_word_embeddings,
            attention_bias=False,
        )
        with torch.device("meta"):
            model = Qwen3ForCausalLM(hf_cfg)
        # The same tensors (the fused projections' parts as views): no second copy.
        model.load_state_dict(hf_state_dict(self.target), strict=False, assign=True)
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to(self.device)
        model.eval().generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        prompt_len, new, batch, _ = self.sizes
        for rows in (1, batch):
            ids = torch.tensor(
                self.reference_prompt if rows == 1 else self.prompts(rows, prompt_len), device=self.device
            )
            for cache, count in (("default", 64 if not self.dry else 8), ("static", 32 if not self.dry else 8)):
                kwargs = dict(max_new_tokens=count, min_new_tokens=count, do_sample=False)
                if cache == "static":
                    kwargs["cache_implementation"] = "static"
                with torch.no_grad():
                    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
                    secs, out = self.timed(lambda: model.generate(ids, **kwargs))
                row = {
                    "stage": "hf",
                    "row": f"transformers {transformers.__version__} generate, {cache} cache",
                    "batch": rows,
                    "new_tokens": count,
                    "ms_per_token": round(1e3 * secs / count, 2),
                    "tokens_per_s": round(rows * count / secs, 1),
                }
                if rows == 1:
                    got = out[0, ids.shape[1] :].tolist()
                    same = next((i for i, (a, b) in enumerate(zip(got, self.reference)) if a != b), min(len(got), 32))
                    row["agrees_with_ours_tokens"] = same
                self.add(row)

    def verify(self) -> None:
        context = 24 if self.dry else 384
        block = self.cfg.drafter.block_size
        decoder = Decoder(self.target, 1, context + 2 * block + 8, self.cfg.drafter.target_layer_ids)
        decoder.prefill(self.prompts(1, context))
        results = {}
        for t in (1, block):
            ids = torch.tensor(self.prompts(1, t), device=self.device)
            times = []
            for i in range(53):
                decoder.crop(context)
                secs, _ = self.timed(lambda: decoder.step(ids))
                if i >= 3:  # the first ones capture the graph
                    times.append(secs)
            results[t] = 1e3 * statistics.median(times)
        self.add(
            {
                "stage": "verify",
                "row": f"step after {context} cached tokens",
                "decode_ms": round(results[1], 2),
                "verify_ms": round(results[block], 2),
                "block": block,
                "verify_over_decode": round(results[block] / results[1], 3),
            }
        )

    def profile(self) -> None:
        prompt_len, _, batch, _ = self.sizes
        graph_ms = next((r["ms_per_token"] for r in self.rows if r.get("row") == "ours, CUDA graphs"), None)
        self.profile_step(1, prompt_len, graph_ms)
        # A regen batch's step halfway through its 512 new tokens (`data regen`'s default batch).
        self.profile_step(batch, prompt_len + self.sizes[3] // 2, None)

    def profile_step(self, rows: int, cached: int, graph_ms: float | None) -> None:
        """One decode step of `rows` rows after `cached` slots, its kernels by kind (a table row)."""
        steps = 8
        decoder = Decoder(self.target, rows, cached + 4 * steps, graphs=False, compile=self.device.type == "cuda")
        decoder.prefill(self.prompts(rows, cached))
        ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        for _ in range(steps):  # compiles the layer parts
            decoder.step(ids)
        eager_s, _ = self.timed(lambda: [decoder.step(ids) for _ in range(steps)])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                decoder.step(ids)
            self.sync()
        times = kernel_times(prof, self.device)
        by_kind: dict[str, float] = defaultdict(float)
        by_name: dict[str, float] = defaultdict(float)
        for name, us in times:
            by_kind[kind_of(name)] += us / 1e3 / steps
            by_name[name] += us / 1e3 / steps
        total = sum(by_kind.values())
        self.add(
            {
                "stage": "profile",
                "row": f"one decode step, batch {rows}, {cached} cached slots, kernels (ms per step)",
                "kernels_per_step": round(len(times) / steps, 1),
                "kernel_ms": round(total, 3),
                "by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                # Every weight is read once a step, nearly all of it by the GEMMs.
                "gemm_tb_per_s": round(self.weight_bytes() / (by_kind["gemm"] * 1e-3) / 1e12, 2)
                if by_kind["gemm"]
                else None,
                "graph_ms_per_token": graph_ms,
                "gaps_ms": round(graph_ms - total, 3) if graph_ms else None,
                "eager_ms_per_step": round(1e3 * eager_s / steps, 2),
                "top": [[n[:90], round(ms, 3)] for n, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]],
            }
        )

    def inductor(self) -> None:
        prompt_len, new, batch, batch_new = self.sizes
        prompt = self.prompts(1, prompt_len)
        prompts = self.prompts(batch, prompt_len)
        graphs = self.device.type == "cuda"  # on the CPU (a dry run) eager: checks the loop only
        pdl = {"triton.enable_pdl": True}
        tuned = {"coordinate_descent_tuning": True, **pdl}
        settings = (
            ("inductor default", {}),
            ("programmatic dependent launch", pdl),
            ("max-autotune + coordinate descent + PDL", {"max_autotune": True, **tuned}),
            ("inductor default (again)", {}),
            ("coordinate descent + PDL", tuned),
        )
        for label, options in settings:
            torch._dynamo.reset()  # the parts compile again, under these settings
            with torch._inductor.config.patch(options):
                decoder = Decoder(self.target, 1, prompt_len + new, graphs=graphs)
                warm_s, _ = self.timed(lambda: generate(self.target, prompt, new, decoder=decoder))
                wide = Decoder(self.target, batch, prompt_len + batch_new, graphs=graphs)
                generate(self.target, prompts, batch_new, decoder=wide)  # every window's graph
            times = [self.timed(lambda: generate(self.target, prompt, new, decoder=decoder))[0] for _ in range(3)]
            secs, out = self.timed(lambda: generate(self.target, prompts, batch_new, decoder=wide))
            self.add(
                {
                    "stage": "inductor",
                    "row": label,
                    "options": options,
                    "ms_per_token": round(1e3 * statistics.median(times) / new, 2),
                    "warm_up_s": round(warm_s, 1),
                    f"batch_{batch}_tokens_per_s": round(sum(map(len, out)) / secs, 1),
                }
            )
            decoder = wide = None  # their caches and graphs go before the next setting's
            gc.collect()
        torch._dynamo.reset()

    def batch(self) -> None:
        prompt_len, _, batch, new = self.sizes
        prompts = self.prompts(batch, prompt_len)
        decoder = Decoder(self.target, batch, prompt_len + new)
        generate(self.target, prompts, new, decoder=decoder)  # warm-up: the graphs of every window
        secs, out = self.timed(lambda: generate(self.target, prompts, new, decoder=decoder))
        produced = sum(len(r) for r in out)
        prefill_s = statistics.median(self.timed(lambda: decoder.prefill(prompts))[0] for _ in range(3))  # eager
        # What the prefill would take through the steps' compiled layer parts (regen runs it eager).
        compiled = decoder._layers
        decoder._layers = lambda *args, eager=False, **kwargs: compiled(*args, **kwargs)
        decoder.prefill(prompts)  # compiles the parts for the prompts' shape
        compiled_s = statistics.median(self.timed(lambda: decoder.prefill(prompts))[0] for _ in range(3))
        decoder._layers = compiled
        self.add(
            {
                "stage": "batch",
                "row": "ours, CUDA graphs" if not self.dry else "ours, eager (CPU)",
                "batch": batch,
                "new_tokens": new,
                "seconds": round(secs, 2),
                "tokens_per_s": round(produced / secs, 1),
                "ms_per_step": round(1e3 * secs / new, 2),
                "prefill_s": round(prefill_s, 3),  # of `seconds`: the prompts' forward, eager
                "prefill_compiled_s": round(compiled_s, 3),  # an experiment, not what regen runs
                "ms_per_step_after_prefill": round(1e3 * (secs - prefill_s) / (new - 1), 2),
            }
        )

    def e2e(self, work: Path) -> None:
        prompt_len, new = (8, 24) if self.dry else (128, 256)
        rows = 32 if self.dry else 128
        data = work / "greedy.jsonl"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with data.open("w") as f:
            for start in range(0, rows, 64):
                prompts = self.prompts(min(64, rows - start), prompt_len)
                for prompt, cont in zip(prompts, generate(self.target, prompts, new)):
                    ids = prompt + cont
                    f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(cont)}) + "\n")
        gen_s = time.perf_counter() - t0
        del self.target  # the trainer and eval processes below need the GPU's memory
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        inventory = work / "hosts.yaml"
        inventory.write_text(
            f"default: local\nhosts:\n  local:\n    transport: local\n"
            f"    workdir: {json.dumps(str(work / 'dflashctl'))}\n"
        )
        env = dict(os.environ, DFLASHCTL_INVENTORY=str(inventory), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        steps = 60 if self.dry else 300
        sets = [
            "data.source=jsonl",
            f"data.train_path={data}",
            f"data.max_length={prompt_len + new}",
            f"data.anchors_per_seq={16 if self.dry else 64}",
            "data.eval_fraction=0.1",
            f"run.steps={steps}",
            f"run.eval_every={steps}",
            f"run.checkpoint_every={steps}",
            "run.log_every=50",
        ]
        if self.dry:
            sets.append("data.batch_size=4")
        args = ["train", "local", "--preset", self.preset, *[a for s in sets for a in ("--set", s)], "--follow"]
        t0 = time.perf_counter()
        train = subprocess.run(
            [sys.executable, "-m", "dflashctl", *args], capture_output=True, text=True, env=env, cwd=work, timeout=400
        )
        train_s = time.perf_counter() - t0
        (self.out / "e2e_train.txt").write_text(train.stdout + train.stderr)
        match = re.search(r"started run (\S+)", train.stderr)
        if train.returncode != 0 or not match:
            self.add({"stage": "e2e", "ok": False, "note": f"train exit {train.returncode}: {train.stderr[-400:]}"})
            return
        run_id = match.group(1)
        shutil.rmtree(work / "dflashctl" / "runs" / run_id / "checkpoints", ignore_errors=True)  # GBs at 8B
        t0 = time.perf_counter()
        ev = subprocess.run(
            [
                sys.executable,
                "-m",
                "dflashctl",
                "eval",
                "local",
                run_id,
                "--max-new-tokens",
                str(new),
                "--count",
                "8",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=work,
            timeout=300,
        )
        eval_s = time.perf_counter() - t0
        (self.out / "e2e_eval.txt").write_text(ev.stdout + ev.stderr)
        try:
            report = json.loads(ev.stdout)
        except ValueError:
            self.add({"stage": "e2e", "ok": False, "note": f"eval exit {ev.returncode}: {ev.stderr[-400:]}"})
            return
        records = [
            json.loads(line)
            for line in (work / "dflashctl" / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        last = [r for r in records if r.get("event") in ("eval", "final")][-1:]
        self.add(
            {
                "stage": "e2e",
                "ok": ev.returncode == 0,
                "data_rows": rows,
                "data_s": round(gen_s, 1),
                "train_s": round(train_s, 1),
                "train_steps": steps,
                "eval_s": round(eval_s, 1),
                "teacher_forced": last[0].get("acceptance_length") if last else None,
                "spec_tau_in_training": last[0].get("spec_tau") if last else None,
                "tau": round(report["tau"], 3),
                "identical": report["identical"],
                "target_ms_per_token": round(report["target_ms_per_token"], 2),
                "spec_ms_per_token": round(report["spec_ms_per_token"], 2),
                "speedup": round(report["speedup"], 3),
                "spec_ms_per_step": round(report["spec_ms_per_step"], 2),
                "step_cost": round(report["step_cost"], 3),
                "by_position": [round(a, 2) for a in report["acceptance_by_position"]],
            }
        )


def main(argv: list[str] | None = None) -> int:
    """Run the stages, print the rows, write decode_bench.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "decode_out")
    ap.add_argument("--work", default="/tmp/dflash-decode", help="scratch workdir for the e2e stage")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset: check the script itself")
    ap.add_argument("--stages", default="decode,hf,verify,profile,inductor,batch,e2e")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, args.dry_run)
    stages = args.stages.split(",")
    failed = False
    for name in ("decode", "hf", "verify", "profile", "inductor", "batch", "e2e"):
        if name not in stages:
            continue
        print(f"=== {name}", flush=True)
        try:
            bench.e2e(Path(args.work)) if name == "e2e" else getattr(bench, name)()
        except Exception as exc:  # noqa: BLE001 - a broken stage is a failed row, the others still run
            failed = True
            bench.add({"stage": name, "ok": False, "note": f"{type(exc).__name__}: {exc}"})
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "cpu",
    }
    (out / "decode_bench.json").write_text(json.dumps({**meta, "rows": bench.rows}, indent=1))
    return 1 if failed or any(r.get("ok") is False for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
