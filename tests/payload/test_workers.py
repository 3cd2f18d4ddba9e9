"""Threaded data-parallel workers on CPU "devices" with the real tiny DFlash drafter.

Covers: identical replicas, equality with one replica on the global batch, every failure path
(build, compile, step 1, step K, a hung worker, a stalled barrier, a diverged replica) ending in
a WorkerError with the worker's traceback, the multi-host hooks, a stop request, and compile
(slow) in two threads. The trainer's process-level paths (exit codes, CLI): test_train.py.
"""

from __future__ import annotations

import dataclasses
import sys
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
from dflash_train.metrics import Cadence  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402
from dflash_train.compiling import EAGER  # noqa: E402 - what the plan picks on the CPU: run.compile off
from dflash_train.replica import build_replica, drafter_ops, forward_backward, optimizer_step  # noqa: E402

STEPS = 6
# Random tokens: every anchor is valid and every micro-batch has the same loss-weight sum, so the
# mean of micro-batch gradients equals the global batch's gradient.
TINY = [
    "data.source=random",
    "data.batch_size=6",
    "data.num_train=36",
    "data.num_eval=6",
    "target.num_layers=4",
    f"run.steps={STEPS}",
]


@pytest.fixture(scope="module")
def setup():
    """Resolved tiny config and its deterministic sampler."""
    cfg = resolve_run(load_config(overrides=TINY)).cfg
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    return cfg, BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)


def run(cfg, sampler, world=3, steps=STEPS, ops=None, on_sync=None, **options):
    """run_threaded over `world` CPU workers with the drafter ops."""
    opts = W.ThreadedOptions(seed=cfg.run.seed, **{"sync_at": W.every(2), **options})
    return W.run_threaded(ops or drafter_ops(cfg), ["cpu"] * world, W.sharded(sampler.batch), steps, opts, on_sync)


def worker_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-worker-")]


def wait_for_workers_to_end(hung_before: set[threading.Thread]) -> None:
    """Every worker thread but those hung on purpose by earlier tests ends (bounded wait)."""

    def alive() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("dflash-worker-") and t not in hung_before]

    deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == []


def two_number_ops() -> W.ReplicaOps:
    """A replica of two numbers: building and stepping it take microseconds, so in the tests of
    1-2 s timeouts only the injected hang or stall can trip one (the tiny drafter's build or step
    takes 0.1-5 s on a busy 2-core machine: a worker's own work would trip them)."""

    def build(device, seed, policy):
        return torch.nn.Parameter(torch.zeros(2, device=device))

    def forward_backward(replica, batch):
        loss = (replica * 1.0).sum()
        loss.backward()
        return loss

    def optimizer_step(replica, keep_grads):
        with torch.no_grad():
            replica -= 0.1 * replica.grad
        if keep_grads:
            replica.grad.zero_()
        else:
            replica.grad = None

    return W.ReplicaOps(build, forward_backward, optimizer_step, lambda replica: [replica])


def test_a_replica_alone_trains_on_released_gradients_exactly_as_on_flat_buffers(setup):
    """One replica with no reduction and no captured optimizer step keeps no flat gradient buffers:
    backward hands over fresh gradients and the optimizer step drops them (at 8B, a read and two
    writes of 4.2 GB of fp32 gradients less per step). The parameters come out bit for bit as with
    the buffers, which a no-op cross-host hook forces here (it makes the run reduce)."""
    cfg, sampler = setup
    base, kept = drafter_ops(cfg), []

    def step(replica, keep_grads):
        kept.append(keep_grads)
        base.optimizer_step(replica, keep_grads)

    alone = run(cfg, sampler, world=1, ops=dataclasses.replace(base, optimizer_step=step))
    flat = run(cfg, sampler, world=1, cross_reduce=lambda flats: None)
    assert kept == [False] * STEPS
    assert all(p.grad is None for p in alone.replicas[0].drafter.parameters())
    assert all(p.grad is not None for p in flat.replicas[0].drafter.parameters() if p.requires_grad)
    pairs = zip(alone.replicas[0].drafter.parameters(), flat.replicas[0].drafter.parameters())
    assert all(torch.equal(a, b) for a, b in pairs)
    assert alone.checksums == flat.checksums


def test_replicas_stay_identical_and_match_one_replica_on_the_global_batch(setup):
    cfg, sampler = setup
    syncs, first_grads = [], {}
    base = drafter_ops(cfg)

    def step(replica, keep_grads):  # the averaged gradients the optimizer sees at step 1, per replica
        if replica.scheduler.last_epoch == 0:
            first_grads[id(replica)] = [p.grad.clone() for p in replica.drafter.parameters()]
        base.optimizer_step(replica, keep_grads)

    opts = W.ThreadedOptions(seed=cfg.run.seed, sync_at=W.every(2))
    result = W.run_threaded(
        dataclasses.replace(base, optimizer_step=step),
        ["cpu"] * 3,
        W.sharded(sampler.batch),
        STEPS,
        opts,
        on_sync=lambda point: syncs.append(point.step),
    )
    assert syncs == [2, 4, 6]
    assert len(set(result.checksums)) == 1
    threaded = [p.detach() for p in result.replicas[0].drafter.parameters()]
    for replica in result.replicas[1:]:  # bit for bit: the replicas must never differ at all
        assert all(torch.equal(a, b) for a, b in zip(threaded, replica.drafter.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(first_grads[id(result.replicas[0])], first_grads[id(replica)]))

    single = build_replica(cfg, "cpu", cfg.run.seed, EAGER)
    lrs = []
    for step_index in range(STEPS):
        forward_backward(single, sampler.batch(step_index))
        if step_index == 0:
            single_grads = [p.grad.clone() for p in single.drafter.parameters()]
        lrs.append(single.optimizer.param_groups[0]["lr"])
        optimizer_step(single)
    # The mean of 3 micro-batch gradients equals the global batch's gradient up to fp32 summation
    # order: measured <= 3e-8 on gradients of size 1e-2..1e-1, so 1e-5 of each tensor's scale is tight.
    for a, b in zip(first_grads[id(result.replicas[0])], single_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    # Parameters after 6 AdamW steps: Adam divides by sqrt(v)+eps, so an element whose gradient is
    # near zero turns an O(1e-8) gradient difference into an O(lr) update difference (measured: one
    # element in 4096 off by 1.6e-5). Honest checks: nearly every element agrees to 1e-6, and none
    # differs by more than the total step budget sum(lr_t) (the most AdamW can move an element
    # with bounded m/sqrt(v) per step here: beta1 0.9 < sqrt(beta2)).
    diffs = torch.cat([(a - b.detach()).abs().flatten() for a, b in zip(threaded, single.drafter.parameters())])
    assert (diffs > 1e-6).float().mean().item() < 1e-3
    assert diffs.max().item() < sum(lrs)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(threaded, build_replica(cfg, "cpu", cfg.run.seed, EAGER).drafter.parameters())
    )
    assert moved > 10 * 1e-6  # training moved the parameters by far more than the tight tolerance


@pytest.mark.parametrize(
    "fail_at,phase",
    [
        ("build", "build"),
        ("compile", "compile/warm-up"),
        ("step:1", "step 1 forward/backward"),
        ("step:4", "step 4 forward/backward"),
    ],
)
def test_a_failing_worker_stops_everyone_with_its_traceback(setup, fail_at, phase):
    cfg, sampler = setup
    hung_before = set(threading.enumerate())
    with pytest.raises(W.WorkerError) as err:
        run(cfg, sampler, fail_at=fail_at, fail_rank=1)
    assert (err.value.rank, err.value.phase) == (1, phase)
    text = str(err.value)
    assert "InjectedFault" in text and "Traceback" in text and "_maybe_fail" in text
    wait_for_workers_to_end(hung_before)


def test_a_non_finite_loss_stops_the_run_at_the_next_sync(setup):
    # Both replicas' weights turn NaN alike after step 1 (their checksums still agree): the loss of
    # step 2 is NaN, and the sync there stops the run instead of training on it.
    cfg, sampler = setup
    base = drafter_ops(cfg)

    def step(replica, keep_grads):
        base.optimizer_step(replica, keep_grads)
        with torch.no_grad():
            next(replica.drafter.parameters()).fill_(float("nan"))

    ops = dataclasses.replace(base, optimizer_step=step)
    with pytest.raises(W.WorkerError, match="the loss is not finite at step 2") as err:
        run(cfg, sampler, world=2, ops=ops)
    assert err.value.rank is None and "NonFiniteLossError" in str(err.value)


def test_a_stalled_worker_is_an_error_not_a_hang(setup):
    # Worker 0 stalls in step 1 until the run has failed (not for a fixed 3 s, which worker 1's own
    # step could outlast on a busy machine): the other's barrier wait must give up, and the stalled
    # worker, once it comes back, ends by itself.
    cfg, sampler = setup
    base = drafter_ops(cfg)
    released = threading.Event()

    def stalled_forward_backward(replica, batch):
        if threading.current_thread().name.endswith("-0"):
            released.wait(60)
        return base.forward_backward(replica, batch)

    ops = dataclasses.replace(base, forward_backward=stalled_forward_backward)
    hung_before = set(threading.enumerate())
    try:
        with pytest.raises(W.WorkerError, match="barrier timed out after 1s") as err:
            run(cfg, sampler, world=2, steps=2, ops=ops, barrier_timeout_s=1.0, warmup_steps=0, grace_s=0.5)
    finally:
        released.set()
    assert err.value.rank == 1 and "phases: ['step 1 forward/backward', 'step 1 gradient all-reduce']" in str(err.value)
    wait_for_workers_to_end(hung_before)


def test_a_diverged_replica_is_an_error(setup):
    cfg, sampler = setup
    base = drafter_ops(cfg)
    built = []

    def build(device, seed, policy):
        replica = base.build(device, seed, policy)
        built.append(replica)
        return replica

    def step(replica, keep_grads):
        base.optimizer_step(replica, keep_grads)
        if replica is built[-1]:  # one replica drifts by one ulp-sized nudge
            with torch.no_grad():
                next(replica.drafter.parameters()).view(-1)[0] += 1e-3

    ops = dataclasses.replace(base, build=build, optimizer_step=step)
    with pytest.raises(W.WorkerError, match="replicas diverged at step 2") as err:
        run(cfg, sampler, world=2, ops=ops)
    assert err.value.rank is None and "DivergenceError" in str(err.value)


@pytest.mark.timeout(60)  # a hang guard: the timeouts below are 1 s
@pytest.mark.parametrize(
    "hang_at,timeouts",
    [
        ("build", {"compile_timeout_s": 1.0}),
        ("compile", {"compile_timeout_s": 1.0}),
        ("step:2", {"barrier_timeout_s": 1.0}),
    ],
)
def test_a_hung_worker_is_an_error_within_the_timeout(setup, hang_at, timeouts):
    # build/compile: the hung worker holds the lock; the other times out waiting for it, or at
    # the ready barrier if it got through first: start-up waits obey compile_timeout_s alone.
    # step:2: the other worker times out at the gradient barrier (barrier_timeout_s).
    cfg, sampler = setup
    with pytest.raises(W.WorkerError) as err:
        run(
            cfg,
            sampler,
            world=2,
            steps=3,
            ops=two_number_ops(),
            hang_at=hang_at,
            fail_rank=1,
            warmup_steps=0,
            grace_s=0.5,
            **timeouts,
        )
    message = str(err.value)
    assert err.value.rank == 0 and "phases:" in message
    assert "waited 1s for the build/compile lock" in message or "barrier timed out after 1s" in message


def test_a_slow_build_is_waited_for_past_the_step_barrier_timeout(setup):
    # CI regression: worker 0 building slowly on a loaded machine must not trip the (tight) step
    # timeout of the worker waiting for the lock or at the ready barrier.
    cfg, sampler = setup
    base = two_number_ops()  # steps in microseconds: only the build is slow
    built = []

    def slow_build(device, seed, policy):
        if not built:  # the first build (under the lock) outlasts the step timeout
            time.sleep(3.5)
        built.append(base.build(device, seed, policy))
        return built[-1]

    result = run(
        cfg,
        sampler,
        world=2,
        steps=2,
        ops=dataclasses.replace(base, build=slow_build),
        barrier_timeout_s=2.0,
        warmup_steps=0,
    )
    assert result.steps == 2 and len(set(result.checksums)) == 1
    assert "hang_forever" not in worker_threads_alive()  # the hung daemon thread is simply left behind


def test_cross_host_hooks_see_replica_zero_buffers_and_checksums(setup):
    cfg, sampler = setup
    reduced, checked = [], []

    def cross_reduce(flats):  # a second host with identical gradients: the mean is unchanged
        reduced.append([(f.device.type, f.dtype, f.numel()) for f in flats])
        for f in flats:
            f.add_(f.clone()).div_(2)

    plain = run(cfg, sampler, world=2, steps=4)
    hooked = run(cfg, sampler, world=2, steps=4, cross_reduce=cross_reduce, cross_check=checked.append)
    assert len(reduced) == 4 and reduced[0] == [
        ("cpu", torch.float32, sum(p.numel() for p in plain.replicas[0].drafter.parameters()))
    ]
    assert len(checked) == 2 and checked[-1] == hooked.checksums[0]  # sync points 2 and 4
    assert hooked.checksums == plain.checksums  # the default path and an identity hook agree bit for bit

    def mismatch(checksum):
        raise W.DivergenceError(f"hosts diverged: {checksum} vs 0")

    with pytest.raises(W.WorkerError, match="hosts diverged") as err:
        run(cfg, sampler, world=2, steps=2, cross_check=mismatch)
    assert err.value.rank is None


def test_on_sync_runs_at_the_steps_the_cadence_names_and_at_the_end(setup):
    cfg, sampler = setup
    syncs = []
    cadence = Cadence(log_every=4, eval_every=3, checkpoint_every=100, total=STEPS + 1)
    run(cfg, sampler, world=2, steps=STEPS + 1, sync_at=cadence.syncs, on_sync=lambda point: syncs.append(point.step))
    assert syncs == [3, 4, 6, 7]


def test_a_stop_request_ends_the_run_at_that_step_with_a_sync(setup):
    cfg, sampler = setup
    seen, steps_done = [], []

    def should_stop():
        steps_done.append(1)
        return len(steps_done) >= 3  # polled once per step

    result = run(
        cfg,
        sampler,
        world=2,
        steps=STEPS,
        sync_at=W.every(5),
        should_stop=should_stop,
        on_start=lambda point: seen.append(("start", point.step)),
    )
    assert result.steps == 3 and len(set(result.checksums)) == 1
    assert seen == [("start", 0)]


def test_bad_fault_spec_is_rejected(setup):
    cfg, sampler = setup
    with pytest.raises(ValueError, match="fail_at"):
        run(cfg, sampler, fail_at="step:0")


@pytest.mark.parametrize(
    "version,expected", [("2.11.0+cu130", "TLS"), ("2.12.1", "per-thread"), ("2.13.0", "unmeasured")]
)
def test_cudagraphs_policy_turns_trees_off_per_call_on_every_version(version, expected):
    def policy(mode: str, gpus: int):
        over = TINY + [f"run.compile={mode}"]
        return resolve_run(load_config(overrides=over), cuda_count=gpus, torch_version=version).policy

    graphs = policy("cudagraphs", 1)
    assert graphs.effective == "cudagraphs" and expected in graphs.reason
    assert graphs.options == {"triton.cudagraphs": True, "triton.cudagraph_trees": False, "graph_partition": False}
    assert policy("cudagraphs", 0).effective == "default"
    assert policy("off", 1).options is None


def compiled_policy(*over: str):
    """The plan's compile policy for TINY with run.compile default on this CPU."""
    return resolve_run(load_config(overrides=TINY + ["run.compile=default", *over]), cuda_count=0).policy


@pytest.mark.slow
def test_compiled_drafter_in_two_threads(setup):
    cfg, sampler = setup
    policy = compiled_policy("run.compile_scope=drafter")
    assert policy.scope == "drafter"
    result = run(cfg, sampler, world=2, steps=2, policy=policy, warmup_steps=1)
    assert result.policy.effective == "default"
    assert len(set(result.checksums)) == 1
    assert all(torch.isfinite(torch.tensor(result.losses)))


@pytest.mark.slow
def test_compiled_whole_step_in_two_threads_matches_eager(setup):
    # run.compile_scope: step (the default): target features, mask, drafter and chunked CE in one
    # compiled function. Cold compile on 2 CPU cores: about 1.5 min; cached afterwards.
    cfg, sampler = setup
    eager = run(cfg, sampler, world=2, steps=2)
    compiled = run(cfg, sampler, world=2, steps=2, policy=compiled_policy(), warmup_steps=1)
    assert len(set(compiled.checksums)) == 1
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)


def test_a_wait_for_the_serial_lock_ends_on_a_stop_or_after_its_timeout():
    """The build/compile lock that the trainer and data regeneration share: a waiter never hangs."""
    stop = threading.Event()
    lock = W.SerialLock(stop, timeout_s=0.3)
    outcome = {}

    def waiter(name: str) -> None:
        try:
            with lock.held(name):
                outcome[name] = "held"
        except (W.Stopped, TimeoutError) as exc:
            outcome[name] = exc

    with lock.held("holder"):
        timed = threading.Thread(target=waiter, args=("timed",))
        timed.start()
        timed.join()
        lock.timeout_s = 600.0
        stopped = threading.Thread(target=waiter, args=("stopped",))
        stopped.start()
        stop.set()
        stopped.join()
    assert isinstance(outcome["timed"], TimeoutError) and "timed waited 0.3s" in str(outcome["timed"])
    assert isinstance(outcome["stopped"], W.Stopped)
    stop.clear()
    waiter("free")
    assert outcome["free"] == "held"
