"""The training program: config, data, the threaded run of `replica.py`'s steps through
`workers.run_threaded` (one thread per device; a single device is the same loop with one
thread), metrics, evaluation, checkpoints, stops, the export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import distributed, launcher, warmup, workers
from .compiling import CompilePolicy, preload_compiler
from .checkpoint import StopFlag, latest_checkpoint, load_checkpoint
from .checkpoint_writer import CheckpointWriter
from .config import Config, ConfigError, dump_yaml, to_dict
from .dashboard import Records, with_tensorboard
from .data import (
    Batch,
    BlockSampler,
    DataError,
    build_datasets,
    demo_prompts,
    demo_refused,
    encode_prompt_rows,
    read_prompt_rows,
)
from .export import export_drafter
from .lines import say
from .model import DFlashDrafter
from .recipe import CHECKPOINT_STEPS, DEFAULT_EPOCHS, EVALUATIONS, cadence_for, epochs_note
from .metrics import Cadence, MetricsLog, TrainMeter, train_line
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
    if cfg.data.spec_prompts_path:
        return sampler, batches, prompts_from_file(cfg)
    return sampler, batches, held_out_prompts(eval_seqs, cfg.run.spec_prompts, cfg.data.prompt_length)


def prompts_from_file(cfg: Config) -> list[list[int]]:
    """The first run.spec_prompts prompts of data.spec_prompts_path, as token ids (ConfigError if bad)."""
    d = cfg.data
    try:
        rows = read_prompt_rows(d.spec_prompts_path)[: cfg.run.spec_prompts]
        return encode_prompt_rows(rows, d.tokenizer_path or cfg.target.path, cfg.target.vocab_size)
    except (DataError, OSError) as exc:
        raise ConfigError(f"data.spec_prompts_path {d.spec_prompts_path}: {exc}") from None


def spec_prompts(cfg: Config) -> list[list[int]]:
    """`load_data(cfg)[2]`, the speculative evaluation's prompts: data.spec_prompts_path's, else
    the held-out split's. The demo source's are its random prompts (held_out_prompts cuts each
    sequence at its first supervised token, the continuation's first): drawn without generating the
    data (the target's greedy decode of every sequence)."""
    d = cfg.data
    if d.spec_prompts_path:
        return prompts_from_file(cfg)
    if d.source == "demo" and demo_refused(cfg) is None:
        if 0 < d.prompt_length < d.max_length:
            prompts = demo_prompts(cfg.target.vocab_size, d, cfg.drafter.mask_token_id, cfg.run.seed)
            return prompts[d.num_train :][: cfg.run.spec_prompts].tolist()
    return load_data(cfg)[2]


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


def run_training(
    cfg: Config,
    resume: bool = False,
    overwrite: bool = False,
    stop: StopFlag | None = None,
    log: Callable[[str], None] = say,
    launched_at: float | None = None,
) -> int:
    """Train end to end on every worker device (`run.gpus`, or `run.threads` x `run.device`)
    through `workers.run_threaded`; returns the exit code (128+signal if stopped). A failing
    or stalled worker raises `workers.WorkerError` (with its traceback). `launched_at`: the
    process's start (time.monotonic), for the time-to-first-step line."""
    launched_at = time.monotonic() if launched_at is None else launched_at
    stop = stop or StopFlag()
    plan = resolve_run(cfg, multi_host=distributed.NodeEnv.from_env(cfg.dist) is not None)
    cfg, devices, notes = plan.cfg, list(plan.devices.workers), list(plan.notes)
    if plan.launcher == "processes":  # one process per device instead
        for line in notes:
            log(line)
        return launcher.run_processes(cfg, devices, resume, overwrite, stop, log)
    if plan.policy.effective != "off":
        preload_compiler()
        notes.append(use_compile_cache(cfg.run.compile_cache_dir))
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Several hosts (WORLD_SIZE > 1, set by `dflashctl train h1,h2`): docs/multihost.md.
    try:
        group = distributed.init_from_env(
            plan.devices.type, len(devices), cfg.dist, log=log, stopped=lambda: stop.requested
        )
    except distributed.RendezvousStopped:  # as a stop before step 1: nothing trained, nothing to save
        log(f"stopped by signal {stop.signum} while waiting for the rendezvous: nothing to save")
        return stop.exit_code
    with group or contextlib.nullcontext():
        return Trainer(plan, out, group, stop, log, notes, launched_at).run(resume, overwrite)


class Trainer:
    """One training run on this host's worker threads, over explicit state: `run` prepares
    (checkpoint, data, run length, the start-up lines), warms up, and runs `workers.run_threaded`,
    whose hooks are the methods `build` (a replica, loaded from the checkpoint), `on_start` (the
    step-0 evaluation and the time to first step) and `on_sync` (metrics, evaluation, checkpoint,
    the final evaluation and export); `metrics.Cadence` decides when each happens."""

    def __init__(
        self,
        plan: RunPlan,
        out: Path,
        group: distributed.NodeGroup | None,
        stop: StopFlag,
        log: Callable[[str], None],
        notes: list[str],
        launched_at: float,
    ):
        self.plan, self.cfg, self.out, self.group, self.stop, self.log = plan, plan.cfg, out, group, stop, log
        self.notes, self.launched_at = notes, launched_at
        self.devices = list(plan.devices.workers)
        self.world = len(self.devices)
        self.main = group is None or group.is_main  # only rank 0 writes checkpoints and the export
        self.ckpt: Path | None = None
        self.start = 0  # steps done before this run (resume)
        self.untrained: float | None = None  # step 0's acceptance length
        self.spec_tau: float | None = None  # the last evaluation's speculative tau
        self.stopped: int | None = None  # the step a stop ended the run after
        self.warmup_at = self.threads_at = 0.0  # when the warm-up and the worker threads started
        # Set by `prepare`: the data, metrics.jsonl and the cadence; by `run`: what the threads use.
        self.sampler: BlockSampler | None = None
        self.eval_batches: list[Batch] = []
        self.spec_prompts: list[list[int]] = []
        self.metrics: Records | None = None  # metrics.jsonl, and TensorBoard with run.tensorboard
        self.cadence: Cadence | None = None
        self.data: GlobalBatches | None = None
        self.ops: workers.ReplicaOps | None = None
        self.meter: TrainMeter | None = None
        self.should_stop: Callable[[], bool] | None = None  # across hosts a distributed.AgreedStop
        self.checkpoints = CheckpointWriter(out, self.cfg.run.keep_checkpoints, log, self.cfg.debug.fail_checkpoint)

    def run(self, resume: bool, overwrite: bool) -> int:
        """Train to run.steps; the exit code (128+signal if stopped)."""
        if not self.prepare(resume, overwrite):
            return 0
        cfg = self.cfg
        self.warmup_at = time.monotonic()
        if self.plan.parallel_warmup == "on" and not warmup.warm_up(
            self.devices,
            self.out / "config.resolved.yaml",
            self.out / "warmup",
            cfg.run.warmup_timeout_s,
            lambda: self.stop.requested,
            self.log,
        ):
            self.log(f"stopped by signal {self.stop.signum} before step {self.start + 1}: nothing to save")
            return self.stop.exit_code
        self.data = GlobalBatches(self.sampler, pin=self.plan.devices.type == "cuda")
        self.ops = drafter_ops(cfg)
        self.meter = TrainMeter(self.start)
        self.threads_at = time.monotonic()
        self.should_stop = (
            self.group.stop_agreement(lambda: self.stop.requested) if self.group else (lambda: self.stop.requested)
        )
        data = self.group.sharded(self.data) if self.group else self.data
        try:
            result = workers.run_threaded(
                dataclasses.replace(self.ops, build=self.build),
                self.devices,
                data,
                self.cadence.total,
                self.options(),
                self.on_sync,
            )
        except BaseException:
            self.checkpoints.settle()
            raise
        return self.outcome(result)

    def prepare(self, resume: bool, overwrite: bool) -> bool:
        """Checkpoint, data, run length, resolved config and the start-up lines; False when the
        checkpoint is already at the run's end (nothing to train)."""
        cfg, out, group = self.cfg, self.out, self.group
        if group is not None and resume:
            self.ckpt = group.sync_checkpoint(out)  # rank 0's latest, on every node
        else:
            self.ckpt = latest_checkpoint(out) if resume else None
        if not resume and latest_checkpoint(out) is not None and not overwrite:
            raise ConfigError(f"{out} already has checkpoints: pass --resume to continue or --overwrite")
        torch.manual_seed(cfg.run.seed)
        workers.use_cpu_threads(cfg.run.cpu_threads)
        self.sampler, self.eval_batches, self.spec_prompts = load_data(
            cfg, group.total_replicas if group else self.world
        )
        self._run_length()
        (out / "config.resolved.yaml").write_text(dump_yaml(cfg))
        self._announce(resume)
        if self.ckpt is not None:
            meta = json.loads((self.ckpt / "meta.json").read_text())
            self.start = meta["step"]
            self.log(f"resuming from {self.ckpt} at step {self.start}")
            changed = _changed_keys(meta["config"], to_dict(cfg))
            if changed:
                self.log(f"warning: config differs from the checkpoint's in {', '.join(changed)}")
        resume_step = self.start if self.ckpt is not None else None
        self.metrics = with_tensorboard(
            MetricsLog(out / "metrics.jsonl", resume_step), cfg.run.tensorboard, out, resume_step
        )
        run = cfg.run
        self.cadence = Cadence(run.log_every, run.eval_every, run.checkpoint_every, run.steps)
        if self.start >= run.steps:
            self.log(f"checkpoint step {self.start} is already at run.steps {run.steps}: nothing to train")
            return False
        return True

    def _run_length(self) -> None:
        """run.steps from run.epochs, or from the data where the preset leaves it unset; then the
        evaluation and checkpoint cadence where the preset leaves it unset."""
        run, per_epoch = self.cfg.run, self.sampler.steps_per_epoch
        if run.epochs > 0:
            run.steps = run.epochs * per_epoch
        elif run.steps is None:  # the real-target preset: the run's length follows the data
            run.steps = DEFAULT_EPOCHS * per_epoch
            self.log(
                f"run length: {run.steps} steps = {DEFAULT_EPOCHS} epochs of {per_epoch} batches "
                f"(run.steps unset; set run.steps or run.epochs to choose)"
            )
        elif self.cfg.target.path and (note := epochs_note(run.steps, per_epoch)):
            self.log(note)
        unset = [name for name in ("eval_every", "checkpoint_every") if getattr(run, name) is None]
        if unset:  # the real-target preset
            eval_every, checkpoint_every = cadence_for(run.steps, run.log_every)
            run.eval_every = run.eval_every or eval_every
            run.checkpoint_every = run.checkpoint_every or checkpoint_every
            self.log(
                f"cadence: an evaluation every {run.eval_every} steps, a checkpoint every {run.checkpoint_every} "
                f"({', '.join('run.' + name for name in unset)} unset: {EVALUATIONS} evaluations a run, "
                f"checkpoints as often and at least every {CHECKPOINT_STEPS} steps)"
            )

    def _announce(self, resume: bool) -> None:
        """The start-up lines: the summary with every decision's reason, the workers, the config file."""
        cfg, policy = self.cfg, self.plan.policy
        with torch.device("meta"):
            n_params = sum(p.numel() for p in DFlashDrafter(drafter_spec(cfg)).parameters())
        for line in summary(cfg, self.notes, n_params):
            self.log(line)
        self.log(
            f"workers: {self.world} thread(s) on {', '.join(self.devices)}, {len(self.sampler.seqs)} training "
            f"sequences; compile {policy.effective}: {policy.reason}"
        )
        self.log(f"full config: {self.out / 'config.resolved.yaml'}")
        if resume and self.ckpt is None:
            self.log(f"no checkpoint in {self.out}: starting from step 0")

    def options(self) -> workers.ThreadedOptions:
        """The threaded run's options: the plan's policy and warm-up, the cadence, faults and hooks."""
        run, debug, group, stop = self.cfg.run, self.cfg.debug, self.group, self.stop
        return workers.ThreadedOptions(
            policy=self.plan.policy,
            seed=run.seed,
            warmup_steps=self.plan.warmup_steps,
            sync_at=self.cadence.syncs,
            barrier_timeout_s=run.barrier_timeout_s,
            compile_timeout_s=run.compile_timeout_s,
            start_step=self.start,
            fail_at=debug.fail_at,
            hang_at=debug.hang_at,
            fail_rank=debug.fail_rank,
            stop_at=debug.stop_at,
            request_stop=lambda: stop.request(signal.SIGTERM),
            should_stop=self.should_stop,
            stop_before_start=lambda: stop.requested,
            on_start=self.on_start,
            on_progress=self.log,
            cross_reduce=group.cross_reduce if group else None,
            cross_check=group.cross_check if group else None,
        )

    def build(self, device: torch.device, seed: int, policy: CompilePolicy) -> Replica:
        """One worker's replica; every replica loads the same checkpoint, so they stay identical."""
        replica = self.ops.build(device, seed, policy)
        if self.ckpt is not None:
            load_checkpoint(self.ckpt, replica.drafter, replica.optimizer, replica.scheduler, device)
        return replica

    def evaluate(self, replica: Replica, step: int, event: str) -> float:
        """The held-out evaluation (and after step 0 the speculative one), logged; its acceptance length."""
        cfg, prompts = self.cfg, self.spec_prompts
        result = evaluate(replica, self.eval_batches)
        spec = ""
        if prompts and step > 0:  # the untrained drafter's real tau is not worth its decode
            t0 = time.monotonic()
            result.update(speculative_eval(replica.target, replica.drafter, prompts, cfg.run.spec_new_tokens))
            result["spec_eval_s"] = time.monotonic() - t0
            spec = (
                f", speculative tau {result['spec_tau_prompt_mean']:.3f} +- {result['spec_tau_prompt_se']:.3f} "
                f"(mean of per-prompt tau +- its standard error; pooled {result['spec_tau']:.3f}; "
                f"{len(prompts)} held-out prompts x {cfg.run.spec_new_tokens} tokens, greedy, "
                f"{result['spec_eval_s']:.1f} s)"
            )
        self.metrics.write({"event": event, "step": step, "total_steps": self.cadence.total, **result})
        self.spec_tau = result.get("spec_tau_prompt_mean")
        self.log(
            f"eval step {step}: held-out loss {result['loss']:.4f}, "
            f"teacher-forced acceptance length {result['acceptance_length']:.3f}{spec}"
        )
        return result["acceptance_length"]

    def save(self, replica: Replica, step: int, durable: bool = True) -> None:
        """A checkpoint of replica 0 after `step`: copied to host memory now, written in the background."""
        self.checkpoints.save(
            step, replica.drafter, replica.optimizer, replica.scheduler, to_dict(self.cfg), replica.device, durable
        )

    def reserve_buffers(self, replica: Replica) -> None:
        """Rank 0: start allocating the checkpoints' host buffers once the optimizer holds its state
        (after the first step; at a resume's start, from the checkpoint), so that a save finds them."""
        if self.main and replica.optimizer.state and not self.checkpoints.reserved:
            self.checkpoints.reserve(
                replica.drafter, replica.optimizer, replica.scheduler, to_dict(self.cfg), replica.device
            )

    def on_start(self, point: workers.SyncPoint) -> None:
        """Rank 0's thread after warm-up, every other worker waiting: step 0's evaluation, the time to first step."""
        ready_at = time.monotonic()
        for replica in point.replicas:  # warm-up is over: no progress probes in the steps' layer loops
            stop_progress_probes(replica)
        if self.plan.policy.effective != "off":
            self.log(
                f"compiled and warmed up: {' / '.join(f'{s:.1f}' for s in point.warmup_s)} s per worker; "
                f"{warmup.cache_stats()}"
            )
        if self.start == 0:
            self.untrained = self.evaluate(point.replicas[0], 0, "eval")
        self.reserve_buffers(point.replicas[0])  # resumed: the optimizer's state is the checkpoint's
        now = time.monotonic()
        parallel_s = self.threads_at - self.warmup_at
        timing = {
            "time_to_first_step_s": now - self.launched_at,
            # The process's start on the wall clock: a caller that knows when its command began (the
            # CLI's pre-flight, another import of torch, comes first) can tell the whole wait.
            "launched_at_unix": time.time() - (now - self.launched_at),
            "before_workers_s": self.warmup_at - self.launched_at,
            "parallel_warmup_s": parallel_s,
            "workers_ready_s": ready_at - self.threads_at,
            "warmup_s": list(point.warmup_s),
            "first_eval_s": now - ready_at,
        }
        self.metrics.write({"event": "start", "step": self.start, **timing})
        parallel = f"parallel warm-up {parallel_s:.1f} s; " if self.plan.parallel_warmup == "on" else ""
        self.log(
            f"time to first step: {timing['time_to_first_step_s']:.1f} s (start-up, config and data "
            f"{timing['before_workers_s']:.1f} s; {parallel}build, compile and warm-up "
            f"{timing['workers_ready_s']:.1f} s; step-{self.start} evaluation {timing['first_eval_s']:.1f} s)"
        )
        self.meter.restart_clock()

    def on_sync(self, point: workers.SyncPoint) -> bool:
        """Rank 0's thread, every other worker waiting: metrics, eval, checkpoint, export; True stops the run."""
        replica, done, cadence = point.replicas[0], point.step, self.cadence
        losses = self.group.mean(point.loss_sums) if self.group else sum(point.loss_sums) / self.world
        self.meter.add(losses, point.steps_since_last)
        stopping = self.should_stop.requested if self.group else self.stop.requested
        self.checkpoints.poll()  # a failed background write fails the run here, at the next sync point
        self.reserve_buffers(replica)
        if cadence.logs(done, stopping):
            tokens = self.data.take_tokens(self.meter.record_step, done)
            record = self.meter.record(done, cadence.total, tokens, replica, [r.device for r in point.replicas])
            if cadence.evaluates(done):
                record["acceptance_length"] = self.evaluate(replica, done, "eval")
            self.metrics.write(record)
            self.log(train_line(record))
        scheduled, final = cadence.checkpoints(done, stopping), cadence.ends(done, stopping)
        if self.main and self.checkpoints.due(done, scheduled, final):
            # A stop's checkpoint is flushed by a process of its own after the exit (checkpoint_flush.py):
            # the stop waits seconds less at 8B; the others are on disk before they count.
            self.save(replica, done, durable=not stopping)
        if stopping:
            self.checkpoints.wait()  # the stop's checkpoint is written before the run ends
            self.stopped = done
            return True
        if done == cadence.total:
            self.finish(replica, point.checksum)
        self.meter.restart_clock()
        return False

    def finish(self, replica: Replica, checksum: int) -> None:
        """After the last step: the final evaluation and (rank 0) the export."""
        total = self.cadence.total
        self.log(f"workers: {self.world} replica(s) in sync at step {total} (parameter checksum {checksum})")
        final = self.evaluate(replica, total, "final")
        if self.main:
            export_dir = export_drafter(
                replica.drafter, self.cfg.target, self.cfg.run.export_dir, DTYPES[self.cfg.run.dtype]
            )
            self.log(f"exported drafter to {export_dir}")
        self.checkpoints.wait()  # the last checkpoint, written while the final evaluation and export ran
        before = f" (untrained: {self.untrained:.3f})" if self.untrained is not None else ""
        real = (
            f"; speculative tau {self.spec_tau:.3f} (mean of per-prompt tau: real draft-and-verify decoding, greedy)"
            if self.spec_tau is not None
            else " (a proxy, not tau: above the real tau in every run measured; `dflashctl eval` measures tau)"
        )
        self.log(f"final held-out teacher-forced acceptance length: {final:.3f}{before}{real}")

    def outcome(self, result: workers.ThreadedResult) -> int:
        """The exit code of a finished threaded run, with its last line where it stopped early."""
        stop = self.stop
        if result.stopped_before_start:
            self.log(f"stopped by signal {stop.signum} before step {self.start + 1}: nothing to save")
            return stop.exit_code
        if self.stopped is not None:
            by = f"signal {stop.signum}" if stop.requested else "another node's stop request"
            # What the trainer's part of a stop took (reaching a sync point, the checkpoint on disk); the
            # rest of what `runs stop` waits is the process's exit.
            took = f" (stopped {time.monotonic() - stop.at:.1f} s after the signal)" if stop.at is not None else ""
            self.log(f"stopped by {by} after step {self.stopped}; to continue, run again with --resume{took}")
            if not stop.requested:
                distributed.record_agreed_stop(f"{by}, after step {self.stopped}")
            return stop.exit_code if stop.requested else 128 + signal.SIGTERM
        return 0
