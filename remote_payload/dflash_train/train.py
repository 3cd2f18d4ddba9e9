"""The training program: config, data, the threaded run of `replica.py`'s steps through
`workers.run_threaded` (one thread per device; a single device is the same loop with one
thread), metrics, evaluation, checkpoints, stops, the export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import distributed, launcher, warmup, workers
from .compiling import CompilePolicy, preload_compiler
from .checkpoint import StopFlag, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, ConfigError, dump_yaml, to_dict
from .data import Batch, BlockSampler, DataError, build_datasets
from .export import export_drafter
from .model import DFlashDrafter
from .recipe import DEFAULT_EPOCHS
from .replica import DTYPES, Replica, drafter_ops, evaluate, stop_progress_probes
from .plan import RunPlan, resolve_run
from .resolve import drafter_spec, summary
from .speculate import held_out_prompts, speculative_eval


def load_data(cfg: Config, world: int = 1) -> tuple[BlockSampler, list[Batch], list[list[int]]]:
    """The sampler of global batches (`data.batch_size` sequences per replica, `world` replicas),
    the fixed held-out batches (first epoch's anchors, unshuffled, one replica's size), and the
    held-out prompts of the speculative evaluation."""
    try:
        train_seqs, eval_seqs = build_datasets(cfg, cfg.drafter.mask_token_id)
    except (DataError, OSError) as exc:  # bad input: one line for the user, like a bad config
        raise ConfigError(f"data: {exc}") from None
    global_cfg = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * world)
    try:
        sampler = BlockSampler(train_seqs, global_cfg, cfg.drafter.block_size, cfg.run.seed)
    except ValueError as exc:
        raise ConfigError(f"{exc} (data.batch_size {cfg.data.batch_size} x {world} worker(s))") from None
    eval_cfg = dataclasses.replace(cfg.data, batch_size=min(cfg.data.batch_size, len(eval_seqs)))
    held_out = BlockSampler(eval_seqs, eval_cfg, cfg.drafter.block_size, cfg.run.seed + 1, shuffle=False)
    batches = [held_out.batch(i) for i in range(min(cfg.run.eval_batches, held_out.steps_per_epoch))]
    return sampler, batches, held_out_prompts(eval_seqs, cfg.run.spec_prompts, cfg.data.prompt_length)


class GlobalBatches:
    """`data(step, rank, world)` for run_threaded: each global batch is built once (by the first
    worker to ask) and sliced per rank; its token count is kept for tokens/s. `pin`: keep batches
    in page-locked memory (for CUDA workers; the slices stay pinned)."""

    def __init__(self, sampler: BlockSampler, pin: bool = False):
        self.sampler = sampler
        self.pin = pin
        self.lock = threading.Lock()
        self.cache: dict[int, Batch] = {}
        self.tokens: dict[int, int] = {}

    def __call__(self, step: int, rank: int, world: int) -> Batch:
        with self.lock:
            batch = self.cache.get(step)
            if batch is None:
                batch = self.sampler.batch(step)
                batch = self.cache[step] = batch.pinned() if self.pin else batch
                self.tokens[step] = batch.num_tokens
                # Workers are at most one step apart (a barrier per step): older batches are done.
                for old in [s for s in self.cache if s < step - 1]:
                    del self.cache[old]
        return workers.shard_batch(batch, rank, world) if world > 1 else batch

    def take_tokens(self, first: int, last: int) -> int:
        """Tokens of the global batches of 0-based steps first..last-1, forgotten afterwards."""
        with self.lock:
            total = sum(self.tokens.pop(s, 0) for s in range(first, last))
            for old in [s for s in self.tokens if s < first]:
                del self.tokens[old]
        return total


class MetricsLog:
    """Appends JSON lines to <out>/metrics.jsonl."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            # Drop what the interrupted run logged after its last checkpoint.
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        """Append one record."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def _gpu_mem_gb(devices: list[torch.device]) -> float | None:
    """Peak allocated memory of the most loaded worker GPU (None on CPU)."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not cuda:
        return None
    return round(max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30, 3)


def use_compile_cache(path: str | None) -> str:
    """Point Inductor's on-disk caches (FX graphs, AOTAutograd, its Triton kernels) at `path`
    before anything compiles, unless the environment already names one; returns the decision.
    Inductor reads TORCHINDUCTOR_CACHE_DIR at its first compile (it has no config key for it)."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        return f"compile cache: {given} (TORCHINDUCTOR_CACHE_DIR from the environment)"
    if path is None:
        return "compile cache: torch's default under the temp dir (run.compile_cache_dir unset)"
    cache = Path(path).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    warm = any(cache.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return f"compile cache: {cache} ({'warm: kept from earlier runs' if warm else 'cold: first run here'})"


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False,
                 stop: StopFlag | None = None, log: Callable[[str], None] = print,
                 launched_at: float | None = None) -> int:
    """Train end to end on every worker device (`run.gpus`, or `run.threads` x `run.device`)
    through `workers.run_threaded`; returns the exit code (128+signal if stopped). A failing
    or stalled worker raises `workers.WorkerError` (with its traceback). `launched_at`: the
    process's start (time.monotonic), for the time-to-first-step line."""
    launched_at = time.monotonic() if launched_at is None else launched_at
    plan = resolve_run(cfg, multi_host=distributed.NodeEnv.from_env(cfg.dist) is not None)
    cfg, devices, notes = plan.cfg, list(plan.devices.workers), list(plan.notes)
    if plan.launcher == "processes":  # one process per device instead
        for line in notes:
            log(line)
        return launcher.run_processes(cfg, devices, resume, overwrite, stop or StopFlag(), log)
    if plan.policy.effective != "off":
        preload_compiler()
        notes.append(use_compile_cache(cfg.run.compile_cache_dir))
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Several hosts (WORLD_SIZE > 1, set by `dflashctl train h1,h2`): docs/multihost.md.
    group = distributed.init_from_env(plan.devices.type, len(devices), cfg.dist, log=log)
    with group or contextlib.nullcontext():
        return _train(plan, out, group, resume, overwrite, stop, log, notes, launched_at)


def _train(plan: RunPlan, out: Path, group: distributed.NodeGroup | None, resume: bool,
           overwrite: bool, stop: StopFlag | None, log: Callable[[str], None], notes: list[str],
           launched_at: float) -> int:
    cfg, devices, policy = plan.cfg, list(plan.devices.workers), plan.policy
    world = len(devices)
    main = group is None or group.is_main  # only rank 0 writes checkpoints and the export
    if group is not None and resume:
        ckpt = group.sync_checkpoint(out)  # rank 0's latest, on every node
    else:
        ckpt = latest_checkpoint(out) if resume else None
    if not resume and latest_checkpoint(out) is not None and not overwrite:
        raise ConfigError(f"{out} already has checkpoints: pass --resume to continue or --overwrite")
    torch.manual_seed(cfg.run.seed)
    workers.use_cpu_threads(cfg.run.cpu_threads)

    sampler, eval_batches, spec_prompts = load_data(cfg, group.total_replicas if group else world)
    if cfg.run.epochs > 0:
        cfg.run.steps = cfg.run.epochs * sampler.steps_per_epoch
    elif cfg.run.steps is None:  # the real-target preset: the run's length follows the data
        cfg.run.steps = DEFAULT_EPOCHS * sampler.steps_per_epoch
        log(f"run length: {cfg.run.steps} steps = {DEFAULT_EPOCHS} epochs of {sampler.steps_per_epoch} batches "
            f"(run.steps unset; set run.steps or run.epochs to choose)")

    (out / "config.resolved.yaml").write_text(dump_yaml(cfg))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in DFlashDrafter(drafter_spec(cfg)).parameters())
    for line in summary(cfg, notes, n_params):
        log(line)
    log(f"workers: {world} thread(s) on {', '.join(devices)}, {len(sampler.seqs)} training sequences; "
        f"compile {policy.effective}: {policy.reason}")
    log(f"full config: {out / 'config.resolved.yaml'}")
    if resume and ckpt is None:
        log(f"no checkpoint in {out}: starting from step 0")

    start = 0
    if ckpt is not None:
        meta = json.loads((ckpt / "meta.json").read_text())
        start = meta["step"]
        log(f"resuming from {ckpt} at step {start}")
        changed = _changed_keys(meta["config"], to_dict(cfg))
        if changed:
            log(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
    metrics = MetricsLog(out / "metrics.jsonl", start if ckpt is not None else None)
    total = cfg.run.steps
    if start >= total:
        log(f"checkpoint step {start} is already at run.steps {total}: nothing to train")
        return 0
    stop = stop or StopFlag()
    warmup_at = time.monotonic()
    if plan.parallel_warmup == "on":
        if not warmup.warm_up(devices, out / "config.resolved.yaml", out / "warmup", cfg.run.warmup_timeout_s,
                              lambda: stop.requested, log):
            log(f"stopped by signal {stop.signum} before step {start + 1}: nothing to save")
            return stop.exit_code
    data = GlobalBatches(sampler, pin=plan.devices.type == "cuda")
    ops = drafter_ops(cfg)

    def build(device: torch.device, seed: int, pol: CompilePolicy) -> Replica:
        replica = ops.build(device, seed, pol)
        if ckpt is not None:  # every replica loads the same checkpoint: still identical
            load_checkpoint(ckpt, replica.drafter, replica.optimizer, replica.scheduler, device)
        return replica

    state = {"loss_sum": 0.0, "steps": 0, "record_step": start, "t0": time.perf_counter(),
             "untrained": None, "stopped": None, "spec_tau": None}
    threads_at = time.monotonic()
    parallel_warmup_s = threads_at - warmup_at

    def run_eval(replica: Replica, step: int, event: str) -> float:
        result = evaluate(replica, eval_batches)
        spec = ""
        if spec_prompts and step > 0:  # the untrained drafter's real tau is not worth its decode
            t0 = time.monotonic()
            result.update(speculative_eval(replica.target, replica.drafter, spec_prompts, cfg.run.spec_new_tokens))
            result["spec_eval_s"] = time.monotonic() - t0
            spec = (f", speculative tau {result['spec_tau_prompt_mean']:.3f} +- {result['spec_tau_prompt_se']:.3f} "
                    f"(mean of per-prompt tau +- its standard error; pooled {result['spec_tau']:.3f}; "
                    f"{len(spec_prompts)} held-out prompts x {cfg.run.spec_new_tokens} tokens, greedy, "
                    f"{result['spec_eval_s']:.1f} s)")
        metrics.write({"event": event, "step": step, "total_steps": total, **result})
        state["spec_tau"] = result.get("spec_tau_prompt_mean")
        log(f"eval step {step}: held-out loss {result['loss']:.4f}, "
            f"teacher-forced acceptance length {result['acceptance_length']:.3f}{spec}")
        return result["acceptance_length"]

    def save(replica: Replica, step: int) -> None:
        path = save_checkpoint(out, step, replica.drafter, replica.optimizer, replica.scheduler,
                               to_dict(cfg), replica.device, cfg.run.keep_checkpoints)
        log(f"checkpoint: {path}")

    def on_start(point: workers.SyncPoint) -> None:
        ready_at = time.monotonic()
        for replica in point.replicas:  # warm-up is over: no progress probes in the steps' layer loops
            stop_progress_probes(replica)
        if policy.effective != "off":
            log(f"compiled and warmed up: {' / '.join(f'{s:.1f}' for s in point.warmup_s)} s per worker; "
                f"{warmup.cache_stats()}")
        if start == 0:
            state["untrained"] = run_eval(point.replicas[0], 0, "eval")
        now = time.monotonic()
        timing = {"time_to_first_step_s": now - launched_at, "before_workers_s": warmup_at - launched_at,
                  "parallel_warmup_s": parallel_warmup_s, "workers_ready_s": ready_at - threads_at,
                  "warmup_s": list(point.warmup_s), "first_eval_s": now - ready_at}
        metrics.write({"event": "start", "step": start, **timing})
        parallel = f"parallel warm-up {parallel_warmup_s:.1f} s; " if plan.parallel_warmup == "on" else ""
        log(f"time to first step: {timing['time_to_first_step_s']:.1f} s (start-up, config and data "
            f"{timing['before_workers_s']:.1f} s; {parallel}build, compile and warm-up {timing['workers_ready_s']:.1f} s; "
            f"step-{start} evaluation {timing['first_eval_s']:.1f} s)")
        state["t0"] = time.perf_counter()

    def on_sync(point: workers.SyncPoint) -> bool:
        """Rank 0's thread, every other worker waiting: metrics, eval, checkpoint, export."""
        replica, done = point.replicas[0], point.step
        state["loss_sum"] += group.mean(point.loss_sums) if group else sum(point.loss_sums) / world
        state["steps"] += point.steps_since_last
        stopping = should_stop.requested if group else stop.requested
        eval_now = done % cfg.run.eval_every == 0 and done < total
        if done % cfg.run.log_every == 0 or done == total or eval_now or stopping:
            elapsed = time.perf_counter() - state["t0"]
            steps = max(state["steps"], 1)
            tokens = data.take_tokens(state["record_step"], done)
            record = {"event": "train", "step": done, "total_steps": total,
                      "loss": state["loss_sum"] / steps, "acceptance_length": None,
                      "lr": replica.last_lr, "grad_norm": float(replica.last_grad_norm),
                      "tokens_per_s": tokens / elapsed, "step_time_s": elapsed / steps,
                      "gpu_mem_gb": _gpu_mem_gb([r.device for r in point.replicas]),
                      "train_acceptance_length": float(replica.last_acceptance)}
            if eval_now:
                record["acceptance_length"] = run_eval(replica, done, "eval")
            metrics.write(record)
            log(f"step {done}/{total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"gnorm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
                f"{record['step_time_s'] * 1000:.1f} ms/step")
            state.update(loss_sum=0.0, steps=0, record_step=done)
        if main and (done % cfg.run.checkpoint_every == 0 or done == total or stopping):
            save(replica, done)
        if stopping:
            state["stopped"] = done
            return True
        if done == total:
            log(f"workers: {world} replica(s) in sync at step {done} (parameter checksum {point.checksum})")
            final = run_eval(replica, total, "final")
            if main:
                export_dir = export_drafter(replica.drafter, cfg.target, cfg.run.export_dir, DTYPES[cfg.run.dtype])
                log(f"exported drafter to {export_dir}")
            before = f" (untrained: {state['untrained']:.3f})" if state["untrained"] is not None else ""
            real = (f"; speculative tau {state['spec_tau']:.3f} (mean of per-prompt tau: real draft-and-verify decoding, greedy)"
                    if state["spec_tau"] is not None else
                    " (a proxy: real speculative decoding accepts fewer tokens per step)")
            log(f"final held-out teacher-forced acceptance length: {final:.3f}{before}{real}")
        state["t0"] = time.perf_counter()
        return False

    run = cfg.run
    should_stop = group.stop_agreement(lambda: stop.requested) if group else (lambda: stop.requested)
    options = workers.ThreadedOptions(
        policy=policy, seed=run.seed, warmup_steps=plan.warmup_steps,
        sync_every=math.gcd(run.log_every, run.eval_every, run.checkpoint_every),
        barrier_timeout_s=run.barrier_timeout_s, compile_timeout_s=run.compile_timeout_s, start_step=start,
        fail_at=cfg.debug.fail_at, hang_at=cfg.debug.hang_at, fail_rank=cfg.debug.fail_rank,
        stop_at=cfg.debug.stop_at, request_stop=lambda: stop.request(signal.SIGTERM),
        should_stop=should_stop, stop_before_start=lambda: stop.requested, on_start=on_start,
        on_progress=log,
        cross_reduce=group.cross_reduce if group else None, cross_check=group.cross_check if group else None)
    result = workers.run_threaded(dataclasses.replace(ops, build=build), devices,
                                  group.sharded(data) if group else data, total, options, on_sync)
    if result.stopped_before_start:
        log(f"stopped by signal {stop.signum} before step {start + 1}: nothing to save")
        return stop.exit_code
    if state["stopped"] is not None:
        by = f"signal {stop.signum}" if stop.requested else "another node's stop request"
        log(f"stopped by {by} after step {state['stopped']}; to continue, run again with --resume")
        return stop.exit_code if stop.requested else 128 + signal.SIGTERM
    return 0
