"""GPU checks of issue 27's CUDA-only paths (run by hand on a CUDA machine, from the repo root):

    python3 tests/payload/gpu_targets.py [sliding|hf|presets ...]

sliding  sliding-window drafter layers: the FlexAttention sliding mask against the dense one (same
         fp32 loss and gradients), then a tiny run with them (bf16, flex compiled): loss falls
hf       a tiny Llama checkpoint through transformers in bf16: features against the model's own
         output_hidden_states, then a whole training run per compile scope (step; layers, the
         target's forward launched layer by layer) with the in-training tau (lossless
         greedy speculative decoding through the model's cache)
presets  llama3-8b and qwen3-30b-a3b at real width, 4 target layers: 6 training steps each
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_payload"))

from dflash_train.__main__ import main as train_main  # noqa: E402
from dflash_train.config import load_config  # noqa: E402
from dflash_train.data import BlockSampler, build_datasets  # noqa: E402
from dflash_train.decode import generate  # noqa: E402
from dflash_train.replica import build_replica, forward_loss  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402
from dflash_train.target_config import read_target_config  # noqa: E402
from dflash_train.target_hf import build_hf_target  # noqa: E402

SLIDING = [
    "drafter.num_layers=2",
    'drafter.layer_types=["sliding_attention","full_attention"]',
    "drafter.sliding_window=6",
]


def check_sliding() -> None:
    """Flex vs dense sliding masks (fp32 loss and gradients), then a compiled bf16 run."""
    results = {}
    for attention in ("flex", "dense"):
        plan = resolve_run(
            load_config(
                preset="tiny",
                overrides=SLIDING
                + ["run.device=cuda:0", "run.dtype=fp32", "run.compile=off", f"drafter.attention={attention}"],
            )
        )
        cfg = plan.cfg
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        replica = build_replica(cfg, "cuda:0", 0, plan.policy)
        out = forward_loss(replica, BlockSampler(train, cfg.data, cfg.drafter.block_size, 0).batch(0).to("cuda"))
        out.loss.backward()
        results[attention] = (out.loss.item(), [p.grad.clone() for p in replica.drafter.parameters()])
    (lf, gf), (ld, gd) = results["flex"], results["dense"]
    worst = max((a - b).abs().max().item() for a, b in zip(gf, gd))
    print(f"sliding flex vs dense: loss {lf:.6f} vs {ld:.6f}, max grad diff {worst:.2e}", flush=True)
    assert abs(lf - ld) < 1e-5 and worst < 1e-4
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        code = train_main(
            [
                "--preset",
                "tiny",
                "--set",
                f"run.output_dir={tmp}/run",
                "--set",
                "run.device=cuda:0",
                "--set",
                "run.steps=120",
            ]
            + [a for s in SLIDING for a in ("--set", s)]
        )
        log = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in log if r.get("event") == "train"]
        print(
            f"sliding run: exit {code}, {time.perf_counter() - t0:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
            flush=True,
        )
        assert code == 0 and losses[-1] < 0.8 * losses[0]


def check_hf() -> None:
    """A tiny Llama through transformers on CUDA: features, then runs under both compile scopes."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        config = transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.08)
        model.save_pretrained(f"{tmp}/llama")
        ids = torch.randint(0, 512, (2, 64), device="cuda")
        exact = _hidden(f"{tmp}/llama", ids, torch.float32)  # the fp32 forward: what bf16 rounds
        own = _hidden(f"{tmp}/llama", ids, torch.bfloat16)  # the model's own bf16 forward
        target = build_hf_target(read_target_config(f"{tmp}/llama"), [1, 3], "cuda", torch.bfloat16, whole=True)
        ours = target.features(ids, [1, 3]).float()
        ours_err, own_err = (ours - exact).abs().max().item(), (own - exact).abs().max().item()
        print(
            f"hf bf16 features: max diff from the fp32 forward {ours_err:.2e}, the model's own bf16 "
            f"output_hidden_states {own_err:.2e}; ours vs its own {(ours - own).abs().max().item():.2e} "
            f"(max |value| {exact.abs().max().item():.2e})",
            flush=True,
        )
        # Within bf16 rounding: no farther from the fp32 values than transformers' own bf16 forward is.
        # (An H200 gave 9.4e-02 between ours and the model's own bf16 output, 2026-12-02: two roundings.)
        assert ours_err <= 1.25 * own_err + 1e-6, (ours_err, own_err)
        prompts = torch.randint(2, 512, (64, 8), generator=torch.Generator().manual_seed(0)).tolist()
        news = generate(target, prompts, 120)
        rows = [{"input_ids": p + n, "loss_mask": [0] * 8 + [1] * len(n)} for p, n in zip(prompts, news)]
        Path(f"{tmp}/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # capture_target auto is off for a transformers target (plan.capture_target_decision)
        for scope, capture in (("step", "auto"), ("layers", "auto")):
            t0 = time.perf_counter()
            run = f"{tmp}/run-{scope}"
            sets = [
                f"target.path={tmp}/llama",
                "drafter.mask_token_id=1",
                "data.source=jsonl",
                f"data.train_path={tmp}/train.jsonl",
                "data.max_length=128",
                "data.anchors_per_seq=16",
                "data.batch_size=8",
                "drafter.block_size=8",
                "drafter.num_layers=2",
                "run.steps=200",
                "run.eval_every=200",
                "run.spec_prompts=4",
                "run.spec_new_tokens=32",
                f"run.output_dir={run}",
                "run.device=cuda:0",
                f"run.compile_scope={scope}",
                f"run.capture_target={capture}",
            ]
            code = train_main(["--preset", "tiny"] + [a for s in sets for a in ("--set", s)])
            log = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
            losses = [r["loss"] for r in log if r.get("event") == "train"]
            taus = [round(r["spec_tau"], 2) for r in log if r.get("spec_tau") is not None]
            print(
                f"hf run, scope {scope}, capture_target {capture}: exit {code}, {time.perf_counter() - t0:.0f} s, "
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, spec tau {taus}",
                flush=True,
            )
            assert code == 0 and losses[-1] < 0.8 * losses[0]


def _hidden(path: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoder layers 1 and 3's outputs from the checkpoint's own forward (output_hidden_states), in fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([ref[2], ref[4]], -1).float()


def check_presets() -> None:
    """The two new presets at real width (4 target layers): a few steps each, ms/step printed."""
    for preset in ("llama3-8b", "qwen3-30b-a3b"):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            code = train_main(
                [
                    "--preset",
                    preset,
                    "--set",
                    "target.num_layers=4",
                    "--set",
                    "drafter.target_layer_ids=[0,1,2]",
                    "--set",
                    "run.steps=6",
                    "--set",
                    "run.spec_prompts=0",
                    "--set",
                    f"run.output_dir={tmp}/run",
                    "--set",
                    "run.device=cuda:0",
                ]
            )
            log = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            print(f"{preset} (4 layers): exit {code}, {time.perf_counter() - t0:.0f} s, last {log[-1]}", flush=True)
            assert code == 0


if __name__ == "__main__":
    checks = {"sliding": check_sliding, "hf": check_hf, "presets": check_presets}
    for name in sys.argv[1:] or list(checks):
        checks[name]()
