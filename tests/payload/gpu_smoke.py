"""GPU smoke checks for the trainer (run by hand on a CUDA machine, from the repo root):

    python3 tests/payload/gpu_smoke.py [hf|paths|tiny|8b ...]

hf     our Qwen3 target vs transformers' Qwen3ForCausalLM on the same random checkpoint
paths  flex (CUDA) vs dense attention: same loss and gradients in fp32
tiny   the tiny run on CUDA (bf16, FlexAttention, compile default): time and acceptance length
8b     the qwen3-8b preset: ms/step and peak memory, eager (flex compiled) and compiled
graphstep  run.capture_optimizer auto (clip + AdamW + zero grads replayed as one CUDA graph) vs
       off under run.compile cudagraphs: 30 steps on every GPU (one thread each), losses and
       parameters side by side
graphtarget  run.capture_target on (the target's feature forward replayed as one CUDA graph) vs
       off, compile default, per-layer scope: the graph's features against eager ones on fresh
       inputs, then 30 steps on every GPU (one thread each): losses and checksums must be equal
flexrows  the drafter's attention (model.attend) through compiled FlexAttention against dense fp32
       attention, forward and backward, at the 8B preset's lengths and the tiny preset's, with
       random anchors, padding anchors at 0 and anchors every 6 positions: finite and close; beside
       it, the kernel's row guards dropped (ROWS_GUARANTEED_SAFE), which attend keeps
nosync  the decode path's steps (the target's decode and verify steps, the drafter's context and
       draft steps) replayed under torch.cuda.set_sync_debug_mode("error"): none waits for the GPU
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_payload"))

from dflash_train.config import TargetConfig, load_config  # noqa: E402
from dflash_train.data import BlockSampler, build_datasets  # noqa: E402
from dflash_train.target import build_tiny_target, hf_state_dict, load_hf_target  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402
from dflash_train.replica import build_replica, forward_loss, train_step  # noqa: E402
from dflash_train.train import run_training  # noqa: E402


def check_hf() -> None:
    """Hidden states and logits of our target equal transformers' on one checkpoint (fp32)."""
    from transformers import AutoModelForCausalLM

    cfg = TargetConfig(tie_word_embeddings=False)
    ours = build_tiny_target(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["Qwen3ForCausalLM"],
                    "model_type": "qwen3",
                    "hidden_act": "silu",
                    "attention_bias": False,
                    "num_hidden_layers": cfg.num_layers,
                    "hidden_size": cfg.hidden_size,
                    "intermediate_size": cfg.intermediate_size,
                    "num_attention_heads": cfg.num_heads,
                    "num_key_value_heads": cfg.num_kv_heads,
                    "head_dim": cfg.head_dim,
                    "vocab_size": cfg.vocab_size,
                    "rope_theta": cfg.rope_theta,
                    "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                    "rms_norm_eps": cfg.rms_norm_eps,
                    "tie_word_embeddings": False,
                    "torch_dtype": "float32",
                    "max_position_embeddings": cfg.max_position_embeddings,
                }
            )
        )
        save_file(
            {k: v.clone() for k, v in hf_state_dict(ours).items()},  # clones: fused weights' views share memory
            str(Path(tmp) / "model.safetensors"),
        )
        hf = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).cuda().eval()
        loaded = load_hf_target(tmp, [1, 3], "cuda", torch.float32)
    ids = torch.randint(0, 511, (2, 48), device="cuda")
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    ours = ours.cuda()
    feats = loaded.features(ids, [1, 3])
    ref = torch.cat([out.hidden_states[2], out.hidden_states[4]], -1)
    print(
        f"hf: features max abs diff {(feats - ref).abs().max().item():.2e}, "
        f"logits max abs diff {(ours.logits(ids) - out.logits.float()).abs().max().item():.2e}"
    )


def check_paths() -> None:
    """Flex vs dense on CUDA in fp32: loss and every gradient."""
    grads = {}
    for attention in ("dense", "flex"):
        plan = resolve_run(
            load_config(
                overrides=[
                    "run.device=cuda",
                    "run.dtype=fp32",
                    "run.compile=off",
                    f"drafter.attention={attention}",
                    "drafter.num_layers=2",
                ]
            )
        )
        cfg = plan.cfg
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        replica = build_replica(cfg, "cuda", 0, plan.policy)
        batch = BlockSampler(train, cfg.data, cfg.drafter.block_size, 0).batch(0)
        out = forward_loss(replica, batch)
        out.loss.backward()
        grads[attention] = (out.loss.item(), {k: p.grad.clone() for k, p in replica.drafter.named_parameters()})
    (ld, gd), (lf, gf) = grads["dense"], grads["flex"]
    worst = max(((gd[k] - gf[k]).norm() / gd[k].norm()).item() for k in gd)
    print(f"paths: loss dense {ld:.6f} flex {lf:.6f}; worst relative grad diff {worst:.2e}")


def check_tiny() -> None:
    """The default tiny run on the GPU."""
    for policy in ("off", "default"):
        cfg = load_config(overrides=[f"run.output_dir=/tmp/tiny_{policy}", f"run.compile={policy}"])
        lines = []
        t0 = time.perf_counter()
        rc = run_training(cfg, overwrite=True, log=lines.append)
        print(f"tiny compile={policy}: rc {rc}, {time.perf_counter() - t0:.1f} s; {lines[-1]}")


def check_8b() -> None:
    """Qwen3-8B-shaped step: ms/step and peak memory."""
    for policy in ("off", "default"):
        plan = resolve_run(load_config(preset="qwen3-8b", overrides=[f"run.compile={policy}"]))
        cfg = plan.cfg
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, 0)
        t0 = time.perf_counter()
        replica = build_replica(cfg, "cuda", 0, plan.policy)
        print(f"8b compile={policy}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        for step in range(3):
            t0 = time.perf_counter()
            loss, _ = train_step(replica, sampler.batch(step))
            print(f"  warm-up step {step}: loss {loss.item():.4f} {time.perf_counter() - t0:.1f} s", flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for step in range(3, 8):
            train_step(replica, sampler.batch(step))
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1000
        print(
            f"  {ms:.0f} ms/step ({1000 / ms:.2f} samples/s), peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
            flush=True,
        )
        del replica
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def check_graphstep() -> None:
    """The captured optimizer step against the eager one: same losses and parameters (up to the
    rounding of a tensor lr against a float one), replicas in sync."""
    from dflash_train import workers
    from dflash_train.replica import drafter_ops

    gpus = list(range(torch.cuda.device_count()))
    params = {}
    for capture in ("auto", "off"):
        plan = resolve_run(
            load_config(
                overrides=[
                    "data.source=random",
                    f"data.batch_size={2 * len(gpus)}",
                    "data.num_train=64",
                    "run.steps=30",
                    "run.compile=cudagraphs",
                    f"run.capture_optimizer={capture}",
                    f"run.gpus={gpus}",
                ]
            )
        )
        cfg = plan.cfg
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, 0)
        opts = workers.ThreadedOptions(
            policy=plan.policy, seed=0, warmup_steps=plan.warmup_steps, sync_at=workers.every(10)
        )
        res = workers.run_threaded(
            drafter_ops(cfg), [f"cuda:{g}" for g in gpus], workers.sharded(sampler.batch), 30, opts
        )
        replica = res.replicas[0]
        params[capture] = [p.detach().float().cpu() for p in replica.drafter.parameters()]
        print(
            f"graphstep capture_optimizer={capture}: captured {replica.step_graph is not None}, final losses "
            f"{res.losses}, checksums {res.checksums}, {max(res.step_ms):.2f} ms/step",
            flush=True,
        )
    diff = max((a - b).abs().max().item() for a, b in zip(params["auto"], params["off"]))
    print(f"graphstep: max |param auto - off| = {diff:.3g} (lr 2e-3 per step at most)", flush=True)


def check_graphtarget() -> None:
    """The captured target forward gives the eager features bit for bit, and training with it the
    same losses and parameters as without it."""
    from dflash_train import workers
    from dflash_train.replica import capture_target_forward, drafter_ops

    gpus = list(range(torch.cuda.device_count()))
    over = [
        "data.source=random",
        "data.batch_size=2",
        "data.num_train=64",
        "run.steps=30",
        "run.compile=default",
        "run.compile_scope=layers",
    ]
    plan = resolve_run(load_config(overrides=over + ["run.device=cuda:0"]))
    cfg = plan.cfg
    replica = build_replica(cfg, "cuda:0", 0, plan.policy)
    capture_target_forward(replica)
    layer_ids = replica.drafter.spec.target_layer_ids
    same = []
    for seed in range(3):  # fresh inputs into the static buffer each time
        ids = torch.randint(
            0,
            cfg.target.vocab_size,
            (2, cfg.data.max_length),
            device="cuda",
            generator=torch.Generator("cuda").manual_seed(seed),
        )
        eager = replica.target.features(ids, layer_ids)
        same.append(torch.equal(replica.target_graph(ids, layer_ids), eager))
    print(f"graphtarget: graph features equal to eager on 3 inputs: {same}", flush=True)
    results = {}
    for capture in ("on", "off"):
        plan = resolve_run(load_config(overrides=over + [f"run.capture_target={capture}", f"run.gpus={gpus}"]))
        cfg = plan.cfg
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, 0)
        opts = workers.ThreadedOptions(
            policy=plan.policy, seed=0, warmup_steps=plan.warmup_steps, sync_at=workers.every(10)
        )
        res = workers.run_threaded(
            drafter_ops(cfg), [f"cuda:{g}" for g in gpus], workers.sharded(sampler.batch), 30, opts
        )
        results[capture] = (res.losses, res.checksums)
        print(
            f"graphtarget capture_target={capture}: graph {res.replicas[0].target_graph is not None}, final "
            f"losses {res.losses}, checksums {res.checksums}, {max(res.step_ms):.2f} ms/step",
            flush=True,
        )
    print(f"graphtarget: {'PASS' if all(same) and results['on'] == results['off'] else 'FAIL'}", flush=True)


def flex_anchors(pattern: str, n: int, a: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Anchors [n, a] on g's device: random ones (sorted), a short reply's (its last half padding
    anchors at 0, as collate pads) or every 6 positions from 0."""
    anchors = torch.randint(1, seq_len, (n, a), generator=g, device=g.device).sort(dim=1).values
    if pattern == "padded":
        anchors[:, a // 2 :] = 0
    elif pattern == "every6":
        anchors = (torch.arange(a, device=g.device) * 6 % seq_len).expand(n, a).contiguous()
    return anchors


def attention_error(flex_fn, mask, q, k, v, ref_out, ref_grads) -> str:
    """attend() through `flex_fn` against the fp32 reference: 'ok' with the worst relative error,
    or what broke."""
    from dflash_train.model import attend

    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v, mask, flex_fn)
    out.float().mul(ref_out.detach().sign()).sum().backward()
    got = [out.float(), *(t.grad.float() for t in (q, k, v))]
    if not all(torch.isfinite(x).all() for x in got):
        return f"NOT FINITE ({(~torch.isfinite(got[0])).any(-1).sum().item()} output rows)"
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, [ref_out, *ref_grads]))
    return f"{'ok' if worst < 5e-2 else 'WRONG'} (worst relative error {worst:.1e})"


def check_flexrows() -> None:
    """Compiled FlexAttention as the trainer calls it against dense fp32 attention; beside it, unguarded."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.model import attend, dense_block_mask, flex_block_mask

    def unguarded(*args, **kwargs):
        return compiled(*args, kernel_options={"ROWS_GUARANTEED_SAFE": True}, **kwargs)

    failed = []
    # (context length, anchors, block size, anchor pattern): the 8B preset's and the tiny preset's
    # lengths, each anchor pattern of flex_anchors.
    for seq_len, a, bs, pattern in (
        (3072, 512, 16, "random"), (3072, 512, 16, "padded"), (3072, 512, 16, "every6"), (64, 8, 8, "random"),
    ):  # fmt: skip
        torch._dynamo.reset()  # two compiles per shape, each in full: no recompile limit falls back to eager
        compiled = torch.compile(flex_attention, dynamic=False)
        g = torch.Generator(device="cuda").manual_seed(0)
        anchors = flex_anchors(pattern, 2, a, seq_len, g)
        shape_q, shape_kv = (2, 4, a * bs, 128), (2, 2, a * bs + seq_len, 128)
        q, k, v = (
            torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for s in (shape_q, shape_kv, shape_kv)
        )
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref_out = attend(*ref, dense_block_mask(anchors, seq_len, bs))
        ref_out.mul(ref_out.detach().sign()).sum().backward()
        ref_grads = [t.grad for t in ref]
        mask = flex_block_mask(anchors, seq_len, bs)
        ours = attention_error(compiled, mask, q, k, v, ref_out, ref_grads)
        forced = attention_error(unguarded, mask, q, k, v, ref_out, ref_grads)
        print(
            f"flexrows: {a * bs} queries, {a * bs + seq_len} keys, {pattern} anchors: attend {ours}; "
            f"guards dropped {forced}",
            flush=True,
        )
        if not ours.startswith("ok"):
            failed.append((seq_len, a, bs, pattern))
    assert not failed, f"attend is not finite or not close at {failed}"


def check_nosync() -> None:
    """After their capture, decode steps launch without waiting for the GPU: a wait (a blocking copy
    from host memory, an item()) would keep the GPU's step from overlapping the host's next launch."""
    from dflash_train.decode import Decoder
    from dflash_train.model import DFlashDrafter, DrafterSpec
    from dflash_train.speculate import DraftDecoder

    target = build_tiny_target(TargetConfig(), seed=0).cuda().to(torch.bfloat16)
    spec = DrafterSpec(target.shape, 2, 8, (1, 3), target.cfg.vocab_size - 1)
    drafter = DFlashDrafter(spec)
    drafter.init_weights(0.02, seed=0)  # drawn on the CPU, as the trainer does
    drafter = drafter.cuda().to(torch.bfloat16)
    decoder, drafting = Decoder(target, 1, 512, spec.target_layer_ids), DraftDecoder(drafter, target, 512)
    _, feats = decoder.prefill([[3, 1, 4, 1, 5, 9, 2, 6]])
    drafting.add_context(feats, 0)
    one, block = torch.tensor([[7]], device="cuda"), torch.arange(8, device="cuda")[None]
    for _ in range(2):  # the first call of each shape captures its graph (and waits): not the check
        decoder.step(one)
        _, verified = decoder.step(block)
        drafting.add_context(verified, decoder.length - 8)
        drafting.draft(7, decoder.length)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            decoder.step(one)
            _, verified = decoder.step(block)
            drafting.add_context(verified, decoder.length - 8)
            drafting.draft(7, decoder.length)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"nosync: 80 decode steps launched with no wait for the GPU (cache at {decoder.length} of 512)", flush=True)


if __name__ == "__main__":
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    checks = {
        "hf": check_hf,
        "paths": check_paths,
        "tiny": check_tiny,
        "8b": check_8b,
        "graphstep": check_graphstep,
        "graphtarget": check_graphtarget,
        "nosync": check_nosync,
        "flexrows": check_flexrows,
    }
    for name in sys.argv[1:] or list(checks):
        checks[name]()
