"""The training run's cadence (which steps are sync points) and its meter (step time between records)."""

from __future__ import annotations

from dflash_train.metrics import Cadence, TrainMeter


def test_only_the_steps_that_log_evaluate_or_checkpoint_are_sync_points():
    # The quality bench's cadence for 19,457 steps: log, eval and checkpoint intervals with no common
    # divisor, which once made every step a sync point (a wait for the GPU each step).
    cadence = Cadence(log_every=972, eval_every=6486, checkpoint_every=19457, total=19457)
    synced = [s for s in range(1, 19458) if cadence.syncs(s)]
    wanted = sorted({s for every in (972, 6486, 19457) for s in range(every, 19458, every)})
    assert synced == wanted and len(synced) == 23  # 20 logs, 2 evaluations, 1 checkpoint


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replica:
    last_lr, last_grad_norm, last_acceptance = 1e-3, 0.5, 2.0


def test_step_time_sums_the_steps_between_sync_points_and_leaves_their_work_out():
    clock = Clock()
    meter = TrainMeter(record_step=0, clock=clock)
    clock.now += 3.0  # steps 1-10
    meter.add(20.0, 10)  # a sync point that does not log: an evaluation of 50 s follows
    clock.now += 50.0
    meter.restart_clock()
    clock.now += 1.0  # steps 11-15
    meter.add(5.0, 5)  # the sync point that logs
    record = meter.record(15, 100, tokens=1500, replica=Replica(), devices=[])
    assert record["step_time_s"] == 4.0 / 15
    assert record["tokens_per_s"] == 1500 / 4.0
    assert record["loss"] == 25.0 / 15
    meter.restart_clock()
    clock.now += 2.0  # steps 16-19: the next record counts only these
    meter.add(4.0, 4)
    assert meter.record(19, 100, tokens=400, replica=Replica(), devices=[])["step_time_s"] == 2.0 / 4
