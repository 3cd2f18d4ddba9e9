"""The smoke child of `dflashctl doctor` (`python -m dflash_train.doctor smoke`): the trainer's
tiny step in one worker thread per device under one compile policy, through the run plan and
`workers.run_threaded`; prints one JSON line (its result, or the exception's record)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import traceback
from pathlib import Path

from .doctor_child import frame_where

LOSS_RTOL = 2e-2  # bf16 replicas on identical data agree to ~1%; a broken replica is off by x10


def root_cause(exc: BaseException) -> BaseException:
    """The innermost `raise ... from` cause: WorkerError wraps the worker's own exception."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def exception_record(exc: BaseException) -> dict:
    """An exception as a smoke result: its first line, the file:line of its innermost frame, and
    the innermost trainer frame when the error is raised deeper (in torch)."""
    exc = root_cause(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = frame_where(frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
    ours = [f for f in frames if "/dflash_train/" in f.filename and not f.filename.endswith("/workers.py")]
    if where and ours and ours[-1] is not frames[-1]:
        where += f", from {frame_where(ours[-1].filename, ours[-1].lineno, ours[-1].name)}"
    return {"outcome": "exception", "error": first_line(exc), "where": where}


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def losses_agree(losses: list[float], rtol: float = LOSS_RTOL) -> bool:
    """True when every thread's final loss is within rtol of the first one's."""
    ref = losses[0]
    return all(abs(x - ref) <= rtol * max(abs(ref), 1e-12) for x in losses)


def smoke_policy(name: str, plan):
    """The run plan's CompilePolicy for a doctor policy; trees-on is the doctor's own, the trainer never picks it."""
    import dataclasses

    if name == "cudagraph-trees":
        # What mode="reduce-overhead" sets, with trees left at their default (on).
        options = {"triton.cudagraphs": True, "triton.cudagraph_trees": True}
        return dataclasses.replace(
            plan.policy, requested=name, options=options, reason="reduce-overhead with CUDAGraph Trees"
        )
    return plan.policy


def smoke_plan(device_type: str, policy_name: str | None = None):
    """The trainer's tiny preset planned for this device, with random tokens (the step's cost does
    not depend on them); with a policy, `run.compile` as a user would set it for that policy, so
    that what follows from it (attention backend, compiled CE chunk, captures) matches: `off` is all eager."""
    from .config import load_config
    from .plan import resolve_run

    overrides = ["data.source=random", "data.num_train=32", "data.num_eval=8", f"run.device={device_type}"]
    if policy_name is not None:
        overrides.append(f"run.compile={'cudagraphs' if policy_name == 'cudagraph-trees' else policy_name}")
    return resolve_run(load_config(preset="tiny", overrides=overrides))


def default_compile_mode(device_type: str) -> str:
    """What `run.compile` resolves to when the user leaves it unset (the trainer's own rule)."""
    return smoke_plan(device_type).cfg.run.compile


def smoke_batches(cfg, count: int = 4) -> list:
    """A few fixed tiny batches from the trainer's own data pipeline."""
    from .data import BlockSampler, build_datasets

    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    return [sampler.batch(i) for i in range(count)]


def threaded_smoke(policy_name: str, devices: list[str], steps: int, inject: str | None) -> dict:
    """The trainer's tiny step in one worker thread per device under one policy, via run_threaded."""
    import torch

    from .replica import drafter_ops
    from .workers import ReplicaOps, ThreadedOptions, every, run_threaded

    plan = smoke_plan(devices[0].split(":")[0], policy_name)
    cfg = plan.cfg
    torch.set_num_threads(cfg.run.cpu_threads)  # as the trainer does (threads x OpenMP oversubscribe)
    ops, batches = drafter_ops(cfg), smoke_batches(cfg)
    policy = smoke_policy(policy_name, plan)
    wrapped = ReplicaOps(
        lambda device, seed, _: ops.build(device, seed, policy),
        ops.forward_backward,
        ops.optimizer_step,
        ops.parameters,
        warm_up_step=ops.warm_up_step,
    )
    # Injected faults use the trainer's own mechanism (run config `debug.fail_at` / `debug.hang_at`),
    # at "build": before anything is built, so the CI tests of these paths stay fast.
    fault = {"fail_at": "build"} if inject == "crash" else {"hang_at": "build"} if inject == "hang" else {}
    options = ThreadedOptions(policy=policy, warmup_steps=2, sync_at=every(steps), **fault)
    # Every worker gets the same micro-batch, so equal losses are a correctness check.
    result = run_threaded(wrapped, devices, lambda step, rank, world: batches[step % len(batches)], steps, options)
    return {
        "outcome": "ok",
        "ms_per_step": [round(ms, 2) for ms in result.step_ms],
        "compile_s": [round(s, 1) for s in result.warmup_s],
        "losses": result.losses,
        "losses_agree": losses_agree(result.losses),
    }


def smoke_main(args: argparse.Namespace) -> int:
    """Child entry: one smoke test; prints one JSON line (its result, or the exception's record)."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch  # noqa: F401 - imported before the started file: the parent's clock starts after it
    from . import replica, workers  # noqa: F401

    if args.started_file:
        Path(args.started_file).touch()
    try:
        record = threaded_smoke(args.policy, args.devices.split(","), args.steps, args.inject)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        print(json.dumps(exception_record(exc)), flush=True)
        traceback.print_exc()
        return 1
    print(json.dumps(record), flush=True)
    return 0
