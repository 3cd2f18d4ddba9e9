"""The captured optimizer step (run.capture_optimizer), on the CPU: where it is chosen, and the
parts of its capture that are not CUDA: the rehearsal before capture leaves parameters and
optimizer state exactly as they were (fresh and resumed), and the host-side lr equals the
schedule's. The capture and replay themselves need a GPU: tests/payload/gpu_smoke.py graphstep."""

from __future__ import annotations

import pytest
import torch

from dflash_train.config import load_config
from dflash_train.data import BlockSampler, build_datasets
from dflash_train.plan import resolve_run
from dflash_train.replica import (
    build_replica,
    forward_backward,
    optimizer_step,
    optimizer_tensors,
    rehearse_optimizer_step,
    scheduled_lr,
)

# Weight decay on: a rehearsal on zero gradients then still moves the parameters, so undoing it is tested.
TINY = [
    "data.source=random",
    "data.num_train=16",
    "data.num_eval=4",
    "target.num_layers=4",
    "data.batch_size=4",
    "run.steps=20",
    "optim.weight_decay=0.1",
]


@pytest.fixture(scope="module")
def setup():
    plan = resolve_run(load_config(overrides=TINY), cuda_count=0)
    cfg = plan.cfg
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    return plan, BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)


def test_captured_only_where_the_step_runs_under_cuda_graphs(setup):
    plan, _ = setup

    def captures(*over: str, gpus: int = 1) -> bool:
        return resolve_run(load_config(overrides=TINY + list(over)), cuda_count=gpus).policy.capture_optimizer

    assert captures("run.compile=cudagraphs")
    assert not captures("run.compile=default")
    assert not captures("run.compile=cudagraphs", gpus=0)  # default compile on CPU
    assert not captures("run.compile=cudagraphs", "run.capture_optimizer=off")
    cfg = plan.cfg
    replica = build_replica(cfg, "cpu", cfg.run.seed, plan.policy)  # the CPU path: float lr, as before (golden losses)
    assert not replica.capture_step and isinstance(replica.optimizer.param_groups[0]["lr"], float)


def train(replica, sampler, steps):
    lrs = []
    for step in range(steps):
        forward_backward(replica, sampler.batch(step))
        lrs.append((scheduled_lr(replica), replica.optimizer.param_groups[0]["lr"]))
        optimizer_step(replica)
    return lrs


@pytest.mark.parametrize("trained_first", [0, 3])  # a fresh optimizer, and one with state (resume)
def test_the_rehearsal_before_capture_leaves_no_trace(setup, trained_first):
    plan, sampler = setup
    seed = plan.cfg.run.seed
    rehearsed, twin = (
        build_replica(plan.cfg, "cpu", seed, plan.policy),
        build_replica(plan.cfg, "cpu", seed, plan.policy),
    )
    train(rehearsed, sampler, trained_first)
    train(twin, sampler, trained_first)
    before = [t.detach().clone() for t in optimizer_tensors(rehearsed)]
    forward_backward(rehearsed, sampler.batch(99))  # the warm-up's gradients, zeroed before the rehearsal
    rehearsed.optimizer.zero_grad(set_to_none=False)
    grads = [p.grad for p in rehearsed.drafter.parameters()]
    rehearse_optimizer_step(rehearsed)
    assert all(p.grad is g for p, g in zip(rehearsed.drafter.parameters(), grads))  # same tensors: addresses kept
    after = optimizer_tensors(rehearsed)
    assert len(after) == len(before) + (3 * len(grads) if not trained_first else 0)  # step, exp_avg, exp_avg_sq
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(not t.any() for t in after[len(before) :])  # created by the rehearsal: back to AdamW's zeros
    # And training from here is bit for bit the twin's, which never rehearsed.
    lrs = train(rehearsed, sampler, 4)
    train(twin, sampler, 4)
    assert all(torch.equal(a, b) for a, b in zip(rehearsed.drafter.parameters(), twin.drafter.parameters()))
    assert all(host == group for host, group in lrs)  # the host-side lr is the schedule's, exactly
