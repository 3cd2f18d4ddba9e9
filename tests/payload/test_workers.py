"""Threaded data-parallel workers on CPU "devices" with the real tiny DFlash drafter.

Covers: identical replicas, equality with one replica on the global batch, every failure path
(build, compile, step 1, step K, a stalled barrier, a diverged replica) ending in a WorkerError
with the worker's traceback, a process exiting non-zero, and compile (slow) in two threads.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"
sys.path.insert(0, str(PAYLOAD))

from dflash_train import workers as W  # noqa: E402
from dflash_train.config import load_config  # noqa: E402
from dflash_train.data import BlockSampler, build_datasets  # noqa: E402
from dflash_train.train import build_replica, forward_backward, optimizer_step, resolve_config  # noqa: E402

STEPS = 6
# Random tokens: every anchor is valid and every micro-batch has the same loss-weight sum, so the
# mean of micro-batch gradients equals the global batch's gradient.
TINY = ["data.source=random", "data.batch_size=6", "data.num_train=36", "data.num_eval=6",
        "target.num_layers=4", f"run.steps={STEPS}"]


@pytest.fixture(scope="module")
def setup():
    """Resolved tiny config and its deterministic sampler."""
    cfg = resolve_config(load_config(overrides=TINY))
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    return cfg, BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)


def run(cfg, sampler, world=3, steps=STEPS, ops=None, **options):
    """run_threaded over `world` CPU workers with the drafter ops."""
    opts = W.ThreadedOptions(seed=cfg.run.seed, **{"sync_every": 2, **options})
    return W.run_threaded(ops or W.drafter_ops(cfg), ["cpu"] * world, W.sharded(sampler.batch), steps, opts)


def worker_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-worker-")]


def test_replicas_stay_identical_and_match_one_replica_on_the_global_batch(setup):
    cfg, sampler = setup
    syncs = []
    opts = W.ThreadedOptions(seed=cfg.run.seed, sync_every=2)
    result = W.run_threaded(W.drafter_ops(cfg), ["cpu"] * 3, W.sharded(sampler.batch), STEPS, opts,
                            on_sync=lambda point: syncs.append(point.step))
    assert syncs == [2, 4, 6]
    assert len(set(result.checksums)) == 1
    threaded = [p.detach() for p in result.replicas[0].drafter.parameters()]
    for replica in result.replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(threaded, replica.drafter.parameters()))

    single = build_replica(cfg, "cpu", cfg.run.seed)
    for step in range(STEPS):
        forward_backward(single, sampler.batch(step))
        optimizer_step(single)
    # Summation order differs (micro-batches vs one batch); Adam divides by sqrt(v), so an element
    # with a tiny gradient can move by a fraction of one step: allow a tenth of the peak lr.
    step = cfg.optim.lr
    for a, b in zip(threaded, single.drafter.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-3, atol=step / 10)
    moved = max((a - b).abs().max().item() for a, b in zip(threaded, build_replica(cfg, "cpu", cfg.run.seed)
                                                           .drafter.parameters()))
    assert moved > step  # training moved the parameters by far more than the tolerance


@pytest.mark.parametrize("fail_at,phase", [("build", "build"), ("compile", "compile/warm-up"),
                                           ("step:1", "step 1 forward/backward"),
                                           ("step:4", "step 4 forward/backward")])
def test_a_failing_worker_stops_everyone_with_its_traceback(setup, fail_at, phase):
    cfg, sampler = setup
    with pytest.raises(W.WorkerError) as err:
        run(cfg, sampler, fail_at=fail_at, fail_rank=1)
    assert (err.value.rank, err.value.phase) == (1, phase)
    text = str(err.value)
    assert "InjectedFault" in text and "Traceback" in text and "_maybe_fail" in text
    deadline = time.monotonic() + 10  # a hang guard, not a timing assertion
    while worker_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_threads_alive() == []


def test_a_stalled_worker_is_an_error_not_a_hang(setup):
    cfg, sampler = setup
    base = W.drafter_ops(cfg)
    stall = threading.Event()

    def slow_forward_backward(replica, batch):
        if replica.device.type == "cpu" and stall.is_set() and threading.current_thread().name.endswith("-0"):
            time.sleep(3)  # longer than the barrier timeout below
        return base.forward_backward(replica, batch)

    def build(device, seed, policy):
        replica = base.build(device, seed, policy)
        stall.set()  # warm-up is not stalled: only training steps
        return replica

    ops = dataclasses.replace(base, build=build, forward_backward=slow_forward_backward)
    with pytest.raises(W.WorkerError, match="barrier timed out"):
        run(cfg, sampler, world=2, steps=2, ops=ops, barrier_timeout_s=1.0, warmup_steps=0)


def test_a_diverged_replica_is_an_error(setup):
    cfg, sampler = setup
    base = W.drafter_ops(cfg)
    built = []

    def build(device, seed, policy):
        replica = base.build(device, seed, policy)
        built.append(replica)
        return replica

    def step(replica):
        base.optimizer_step(replica)
        if replica is built[-1]:  # one replica drifts by one ulp-sized nudge
            with torch.no_grad():
                next(replica.drafter.parameters()).view(-1)[0] += 1e-3

    ops = dataclasses.replace(base, build=build, optimizer_step=step)
    with pytest.raises(W.WorkerError, match="replicas diverged at step 2") as err:
        run(cfg, sampler, world=2, ops=ops)
    assert err.value.rank is None and "DivergenceError" in str(err.value)


def test_the_process_exits_nonzero_with_the_worker_traceback():
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(PAYLOAD)!r})
        from dflash_train import workers as W
        from dflash_train.config import load_config
        from dflash_train.data import BlockSampler, build_datasets
        from dflash_train.train import resolve_config
        cfg = resolve_config(load_config(overrides={TINY!r}))
        train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
        sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
        W.run_threaded(W.drafter_ops(cfg), ["cpu", "cpu"], W.sharded(sampler.batch), {STEPS},
                       W.ThreadedOptions(fail_at="step:3", fail_rank=0))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "worker 0 (cpu) failed during step 3 forward/backward" in proc.stderr
    assert "InjectedFault: injected fault at step:3 on worker 0" in proc.stderr


def test_bad_fault_spec_is_rejected(setup):
    cfg, sampler = setup
    with pytest.raises(ValueError, match="fail_at"):
        run(cfg, sampler, fail_at="step:0")


@pytest.mark.parametrize("version,expected", [("2.11.0+cu130", "TLS"), ("2.12.1", "per-thread"),
                                              ("2.13.0", "unmeasured")])
def test_cudagraphs_policy_turns_trees_off_per_call_on_every_version(version, expected):
    policy = W.choose_compile_policy("cudagraphs", "cuda", version)
    assert policy.effective == "cudagraphs" and expected in policy.reason
    assert policy.options == {"triton.cudagraphs": True, "triton.cudagraph_trees": False, "graph_partition": False}
    assert W.choose_compile_policy("cudagraphs", "cpu", version).effective == "default"
    assert W.choose_compile_policy("off", "cuda", version).options is None


@pytest.mark.slow
def test_compiled_drafter_in_two_threads(setup):
    cfg, sampler = setup
    result = run(cfg, sampler, world=2, steps=2, compile="default", warmup_steps=1)
    assert result.policy.effective == "default"
    assert len(set(result.checksums)) == 1
    assert all(torch.isfinite(torch.tensor(result.losses)))
