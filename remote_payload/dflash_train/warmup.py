"""Parallel compile warm-up: before the worker threads start, one short-lived process per device
builds the replica, runs the compiled step once and exits, so that its compile lands in the
on-disk caches (FX graphs, AOTAutograd, Triton kernels) that every process on the box shares.
The threads, whose compiles are serialised, then load the compiled code instead of building it.

    python -m dflash_train.warmup --config RESOLVED.yaml --device cuda:1 --rank 1 --timeout-s 900

The launcher (`run_jobs`) is generic: a list of commands, a timeout, a stop poll. A job that
fails, hangs past the timeout or is stopped is one line with its reason; the run goes on (its
worker then compiles without the cache's help). Why warm-up is serialised in threads:
docs/threaded-compile.md.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.1  # how often the launcher looks at its children and the stop flag
# A child ends itself this long after its timeout if nobody killed it (the trainer died): later
# than the launcher's own kill, so a live launcher always reports a timeout as one.
ORPHAN_GRACE_S = 30.0


@dataclass(frozen=True)
class Job:
    """One warm-up process: a name for messages (the device), its argv, where its output goes."""

    name: str
    argv: list[str]
    log_path: Path


@dataclass
class JobResult:
    """How a job ended: ok | failed | timed out | stopped, with a one-line reason."""

    name: str
    status: str
    seconds: float
    reason: str = ""

    def line(self) -> str:
        """`parallel warm-up: cuda:1 failed after 3.1 s: InjectedFault: ... (log: PATH)`."""
        if self.status == "ok":
            return f"parallel warm-up: {self.name} done in {self.seconds:.1f} s"
        return f"parallel warm-up: {self.name} {self.status} after {self.seconds:.1f} s: {self.reason}"


def last_line(path: Path) -> str:
    """The last non-empty line of a log file (a failed child's error), or ''."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def run_jobs(
    jobs: Sequence[Job], timeout_s: float, should_stop: Callable[[], bool], env: dict[str, str] | None = None
) -> list[JobResult]:
    """Run every job at once, each in its own process group, until all have ended, `timeout_s`
    has passed (the rest are killed) or `should_stop()` is true (all are killed at once). Never
    raises for a job's failure: the results say what happened."""
    t0 = time.monotonic()
    running: dict[int, tuple[Job, subprocess.Popen]] = {}
    results: dict[str, JobResult] = {}
    for i, job in enumerate(jobs):
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        with job.log_path.open("w") as out:
            # Its own session: a kill reaches the compile workers inductor forks, and the terminal's
            # Ctrl-C reaches only the trainer, which then ends the warm-up itself.
            running[i] = (
                job,
                subprocess.Popen(
                    job.argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                ),
            )
    try:
        while running:
            for i, (job, proc) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[i]
                seconds = time.monotonic() - t0
                if code == 0:
                    results[job.name] = JobResult(job.name, "ok", seconds)
                else:
                    why = last_line(job.log_path) or "no output"
                    results[job.name] = JobResult(
                        job.name, "failed", seconds, f"exit {code}: {why} (log: {job.log_path})"
                    )
            if not running:
                break
            if should_stop():
                _kill_all(running, results, t0, "stopped", "stop requested")
                break
            if time.monotonic() - t0 > timeout_s:
                _kill_all(
                    running,
                    results,
                    t0,
                    "timed out",
                    f"still running after {timeout_s:g} s, killed (run.warmup_timeout_s; log: {{log}})",
                )
                break
            time.sleep(POLL_S)
    finally:
        _kill_all(running, results, t0, "stopped", "the launcher ended")  # an exception: leave no child
    return [results[job.name] for job in jobs]


def _kill_all(
    running: dict[int, tuple[Job, subprocess.Popen]], results: dict[str, JobResult], t0: float, status: str, reason: str
) -> None:
    for i, (job, proc) in list(running.items()):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        del running[i]
        results[job.name] = JobResult(job.name, status, time.monotonic() - t0, reason.format(log=job.log_path))


def child_argv(config_path: Path, device: str, rank: int, timeout_s: float) -> list[str]:
    """`python -m dflash_train.warmup ...` for one device (rank: the first worker on it)."""
    return [
        sys.executable,
        "-m",
        "dflash_train.warmup",
        "--config",
        str(config_path),
        "--device",
        device,
        "--rank",
        str(rank),
        "--timeout-s",
        f"{timeout_s:g}",
    ]


def jobs_for(devices: Sequence[str], config_path: Path, log_dir: Path, timeout_s: float) -> list[Job]:
    """One job per distinct device of the workers (replicas sharing a device share its compile)."""
    jobs = []
    for device in dict.fromkeys(devices):
        rank = list(devices).index(device)
        jobs.append(
            Job(device, child_argv(config_path, device, rank, timeout_s), log_dir / f"{device.replace(':', '')}.log")
        )
    return jobs


def child_env() -> dict[str, str]:
    """This environment (TORCHINDUCTOR_CACHE_DIR included), with the payload importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def warm_up(
    devices: Sequence[str],
    config_path: Path,
    log_dir: Path,
    timeout_s: float,
    should_stop: Callable[[], bool],
    log: Callable[[str], None],
) -> bool:
    """The trainer's warm-up: one job per device, a line per job that did not succeed and a summary;
    returns False when a stop request ended it (the caller then exits without training)."""
    jobs = jobs_for(devices, config_path, log_dir, timeout_s)
    log(
        f"parallel warm-up: {len(jobs)} process(es) compiling on {', '.join(j.name for j in jobs)} "
        f"(timeout {timeout_s:g} s, logs in {log_dir})"
    )
    t0 = time.monotonic()
    results = run_jobs(jobs, timeout_s, should_stop, child_env())
    if any(r.status == "stopped" for r in results):
        return False
    for r in results:
        if r.status != "ok":
            log(r.line() + "; its worker compiles without the warm cache")
    ok = sum(r.status == "ok" for r in results)
    log(
        f"parallel warm-up: {ok}/{len(results)} done in {time.monotonic() - t0:.1f} s; "
        f"the worker threads now compile{' from the warm cache' if ok else ''}"
    )
    return True


def cache_stats() -> str:
    """What this process's compiles took from the on-disk caches so far (Dynamo's counters)."""
    from torch._dynamo.utils import counters

    fx, aot = counters["inductor"], counters["aot_autograd"]
    return (
        f"compile cache: FX graphs {fx['fxgraph_cache_hit']} from the cache, {fx['fxgraph_cache_miss']} "
        f"compiled; AOTAutograd {aot['autograd_cache_hit']} from the cache, {aot['autograd_cache_miss']} compiled"
    )


def child_main(argv: list[str] | None = None) -> int:
    """The warm-up process: build the replica on one device as its worker would, run the compiled
    forward/backward once (that is what compiles: gradients and optimizer state are thrown away),
    exit. Honours `debug.fail_at` / `hang_at: compile` for `debug.fail_rank`, like the worker."""
    parser = argparse.ArgumentParser(prog="python -m dflash_train.warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's config.resolved.yaml")
    parser.add_argument("--device", required=True)
    parser.add_argument("--rank", type=int, default=0, help="the first worker on this device (fault injection)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        required=True,
        help=f"the launcher's timeout: exit (stacks in the log) {ORPHAN_GRACE_S:g} s after it",
    )
    args = parser.parse_args(argv)
    # Bounded even if the trainer dies without killing us: dump every thread's stack and exit.
    faulthandler.dump_traceback_later(args.timeout_s + ORPHAN_GRACE_S, exit=True)

    import torch

    from . import workers
    from .config import load_config
    from .data import BlockSampler, random_sequences
    from .faults import InjectedFault
    from .replica import drafter_ops
    from .plan import resolve_run

    over = [f"run.device={args.device}", "run.gpus=[]", "run.threads=1", "run.parallel_warmup=off"]
    cfg = load_config(args.config, overrides=over)
    fail_rank, cfg.debug.fail_rank = cfg.debug.fail_rank, 0  # this process has one worker: args.rank
    plan = resolve_run(cfg)  # this process's one worker on args.device, planned as the trainer plans it
    cfg = plan.cfg
    device = torch.device(args.device)
    workers.use_cpu_threads(cfg.run.cpu_threads)  # as the trainer: CPU kernels are built for it
    if device.type == "cuda":
        torch.cuda.set_device(device)
    policy = plan.policy
    torch.manual_seed(cfg.run.seed)
    ops = drafter_ops(cfg)
    replica = ops.build(device, cfg.run.seed, policy)
    # A batch of the run's static shape and dtypes; its values do not change the compiled code.
    d = cfg.data
    seqs = random_sequences(cfg.target.vocab_size, d.batch_size, d.max_length, cfg.drafter.mask_token_id, cfg.run.seed)
    batch = BlockSampler(seqs, d, cfg.drafter.block_size, cfg.run.seed).batch(0)
    if args.rank == fail_rank:
        if cfg.debug.hang_at == "compile":
            workers.hang_forever()
        if cfg.debug.fail_at == "compile":
            raise InjectedFault(f"injected fault at compile in the warm-up of {args.device}")
    t0 = time.monotonic()
    ops.forward_backward(replica, batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"warm-up {args.device}: compiled in {time.monotonic() - t0:.1f} s; {cache_stats()}", flush=True)
    return 0


if __name__ == "__main__":
    from .fast_exit import exit_now

    exit_now(child_main())
