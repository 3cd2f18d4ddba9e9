"""`run.launcher: processes`: one trainer process per device on this host, on the same worker
code, joined through the multi-host hooks of distributed.py as if each device were a node.

The process that reads the config (this one) resolves it, writes it once, and starts one
`python -m dflash_train` per device with RANK / WORLD_SIZE / MASTER_ADDR=127.0.0.1 /
MASTER_PORT (a free port) / DFLASH_NODES / DFLASH_RUN_ID, exactly what `dflashctl train h1,h2`
gives one process per host. Each child trains one replica in one worker thread on its device
(`run.device=DEV`, `run.launcher=threads`), so its Python holds a GIL of its own; gradients are
averaged by `NodeGroup.cross_reduce` (NCCL on GPUs, gloo on CPU), checksums compared by
`cross_check`, a stop agreed on by every rank, a dead rank noticed by the heartbeats. Rank 0
writes into `run.output_dir` (metrics, checkpoints, export) and its output is this process's;
rank i > 0 uses `<output_dir>/ranks/<i>/` and writes its output to `train.log` there.

This process stays as the launcher: it passes a stop request (SIGTERM/SIGINT) to every child
once, waits for all of them, and exits with rank 0's code (or, if rank 0 succeeded, the first
other non-zero one). `runs stop` signals this process alone (docs/runs.md), so this is how the
children hear of it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import StopFlag, latest_checkpoint
from .config import Config, ConfigError, dump_yaml
from .distributed import AGREED_STOP_ENV

POLL_S = 0.1


@dataclass(frozen=True)
class Rank:
    """One child: its rank, device, output directory and (rank > 0) log file."""

    rank: int
    device: str
    output_dir: Path
    log_path: Path | None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the rendezvous of the children)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def plan(devices: list[str], output_dir: Path) -> list[Rank]:
    """One rank per worker device: rank 0 in output_dir, the others under output_dir/ranks/<i>."""
    ranks = []
    for i, device in enumerate(devices):
        out = output_dir if i == 0 else output_dir / "ranks" / str(i)
        ranks.append(Rank(i, device, out, None if i == 0 else out / "train.log"))
    return ranks


def child_overrides(cfg: Config, r: Rank) -> list[str]:
    """`--set` overrides turning the launcher's resolved config into rank r's: one worker thread
    on its device, its output dir, and the debug fault only where `debug.fail_rank` points."""
    over = [
        f"run.device={r.device}",
        "run.gpus=[]",
        "run.threads=1",
        "run.launcher=threads",
        "run.parallel_warmup=off",
        f"run.output_dir={r.output_dir}",
    ]
    if r.rank == cfg.debug.fail_rank:
        over.append("debug.fail_rank=0")
    else:
        over += ["debug.fail_at=null", "debug.hang_at=null", "debug.stop_at=null", "debug.fail_rank=0"]
    return over


def child_env(r: Rank, world: int, port: int, run_id: str) -> dict[str, str]:
    """The multi-host environment (docs/multihost.md) for rank r of a group on this host."""
    env = dict(os.environ)
    # The ranks' stop agreement is this host's own business: runctl hears of a stop from this process.
    env.pop(AGREED_STOP_ENV, None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(
        RANK=str(r.rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DFLASH_NODES=",".join(f"rank{i}" for i in range(world)),
        DFLASH_RUN_ID=run_id,
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the group lives on this host: gloo over loopback
    return env


def exit_code(codes: list[int]) -> int:
    """Rank 0's exit code, or if it succeeded the first other rank's non-zero one."""
    if codes[0] != 0:
        return codes[0]
    return next((c for c in codes if c != 0), 0)


def run_processes(
    cfg: Config, devices: list[str], resume: bool, overwrite: bool, stop: StopFlag, log: Callable[[str], None]
) -> int:
    """Start one trainer process per device (see the module docstring), wait for all; returns the
    exit code as `python -m dflash_train` would."""
    out = Path(cfg.run.output_dir)
    if not resume and latest_checkpoint(out) is not None and not overwrite:  # rank 0 would refuse it too
        raise ConfigError(f"{out} already has checkpoints: pass --resume to continue or --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "launch.yaml"  # the launcher's resolved config, the base of every rank's
    config_path.write_text(dump_yaml(cfg))
    ranks = plan(devices, out)
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    log(
        f"launcher: {len(ranks)} processes, one per device ({', '.join(devices)}), rendezvous 127.0.0.1:{port}; "
        f"rank 0's output follows, ranks 1.. log to {out / 'ranks'}/<rank>/train.log"
    )
    procs: list[subprocess.Popen] = []
    try:
        for r in ranks:
            argv = [sys.executable, "-m", "dflash_train", "--config", str(config_path)]
            for item in child_overrides(cfg, r):
                argv += ["--set", item]
            argv += ["--resume"] if resume else []
            argv += ["--overwrite"] if overwrite else []
            if r.log_path is None:
                procs.append(
                    subprocess.Popen(argv, env=child_env(r, len(ranks), port, run_id), stdin=subprocess.DEVNULL)
                )
                continue
            r.log_path.parent.mkdir(parents=True, exist_ok=True)
            with r.log_path.open("w") as fh:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=child_env(r, len(ranks), port, run_id),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        forwarded = False
        while any(p.poll() is None for p in procs):
            if stop.requested and not forwarded:
                forwarded = True
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(stop.signum)
            time.sleep(POLL_S)
    finally:
        for p in procs:  # only on an error of this process itself: never leave a child behind
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes[1:]):
        failed = ", ".join(f"rank {r.rank} exit {c} (log: {r.log_path})" for r, c in zip(ranks, codes) if c and r.rank)
        log(f"launcher: {failed}")
    return exit_code(codes)
