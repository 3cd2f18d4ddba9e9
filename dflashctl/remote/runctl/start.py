"""`runctl start` and `runctl resume`: the program's pre-flight, the GPU check and the detached
start, under one lock, so concurrent starts cannot both win."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from ..wire import AGREED_STOP, EXIT, LOG, META, PREFLIGHT_TIMEOUT_S, REASON, RUN_DIR_TOKEN, STOP, WORKDIR_TOKEN
from .common import (
    RUN_ID_RE,
    SUPERVISED,
    SUPERVISOR_POLL_S,
    RunError,
    emit,
    marker,
    read_json,
    runs_lock,
    runs_root,
    signal_group,
    utc_iso,
    write_atomic,
)
from .state import conflicts, named, queued_ahead, resolve, resume_refusal, state_of
from .supervise import supervise


def new_run_id(root):
    """A fresh sortable run id: UTC start time plus 4 random hex digits."""
    while True:
        run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-%04x" % random.getrandbits(16)
        if not os.path.exists(os.path.join(root, run_id)):
            return run_id


def interruptible():
    """Record SIGINT, SIGTERM and SIGHUP instead of dying of them, so that a start decides at one
    point (`check_interrupt`) whether it goes ahead; returns the list that collects them."""
    seen = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: seen.append(signum))
    return seen


def check_interrupt(interrupts):
    """Before a start commits: an interrupt so far means nothing is started (RunError)."""
    if interrupts:
        raise RunError(
            "interrupted",
            "the start was interrupted (signal %d) before the run was created: nothing was started" % interrupts[0],
        )


def remove_unborn(root):
    """Run directories without run.json are what a start killed mid-way (kill -9) left: under the
    start lock no other start is making one, so they go."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if RUN_ID_RE.match(name) and os.path.isdir(path) and not os.path.exists(os.path.join(path, META)):
            shutil.rmtree(path, ignore_errors=True)


def cmd_start(workdir):
    """Pre-flight the program, check GPUs and start a run under one lock, so concurrent starts
    cannot both win; a failed or interrupted pre-flight or a conflict leaves no run behind, and
    once run.json is written the start completes whatever signal comes."""
    interrupts = interruptible()
    spec = json.load(sys.stdin)
    root = runs_root(workdir)
    os.makedirs(root, exist_ok=True)
    with runs_lock(root) as lock:
        remove_unborn(root)
        refuse_taken_name(root, spec)
        run_id = spec.get("run_id") or new_run_id(root)
        if not RUN_ID_RE.match(run_id):
            raise RunError("bad_request", "bad run id %r" % run_id)
        run_dir = os.path.join(root, run_id)
        if os.path.exists(run_dir):
            raise RunError("bad_request", "run %s already exists on this host" % run_id)
        # The payload version itself (push swaps `payload`, a symlink): a later push does not
        # move a running trainer, and run.json says which code it runs.
        cwd = os.path.realpath(os.path.expanduser(spec["cwd"]))
        home = os.path.expanduser(workdir)
        argv = [a.replace(RUN_DIR_TOKEN, run_dir).replace(WORKDIR_TOKEN, home) for a in spec["argv"]]
        os.makedirs(os.path.join(run_dir, "checkpoints"))  # no run.json yet: invisible to list/show
        try:
            gpus, busy = admit(root, run_id, spec, argv, cwd, interrupts)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        meta = new_meta(spec, run_id, run_dir, argv, cwd, gpus, busy)
        write_atomic(os.path.join(run_dir, META), json.dumps(meta, indent=2))
        os.makedirs(meta["cwd"], exist_ok=True)
        sup = spawn_supervisor(run_dir, meta, meta["env"], lock.fileno())
        meta = wait_for_pids(run_dir, sup)
    emit(
        {
            "run_id": run_id,
            "run_dir": run_dir,
            "pid": (meta.get("trainer") or {}).get("pid"),
            "gpus": gpus,
            "queued_behind": meta.get("queued_behind") if meta.get("queued") else None,
        }
    )


def refuse_taken_name(root, spec):
    """A name the user gave must name no other run here (a RunError naming the run that has it):
    checked under the start lock, so two starts racing for one name cannot both win."""
    name = spec.get("name")
    if not name or not spec.get("unique_name"):
        return
    taken = named(root, name)
    if taken:
        run_id, run_dir, meta = taken
        raise RunError(
            "name_taken",
            "a run named %r exists already (%s)" % (name, run_id),
            name=name,
            run_id=run_id,
            state=state_of(run_dir, meta)[0],
        )


def admit(root, run_id, spec, argv, cwd, interrupts):
    """Everything a start may still refuse, in the new run's (unborn) directory: the config file,
    the pre-flight (argv gains the pinning of what it holds), the GPU check. (GPUs held, runs it
    waits for); RunError, or an interrupt, refuses."""
    run_dir = os.path.join(root, run_id)
    if spec.get("config_text") is not None:
        write_atomic(os.path.join(run_dir, spec["config_name"]), spec["config_text"])
    gpus = spec["gpus"]
    if spec.get("preflight"):
        # The program's plan says what the run holds (a remote engine: nothing) and how to pin it
        # there, so that the run uses what is locked.
        found = preflight(argv, cwd, spec.get("env") or {}, interrupts)
        if "holds" not in found:  # an older trainer's answer (its `gpus` key), left by `--no-push`
            raise RunError(
                "preflight",
                "the trainer in the container predates this dflashctl's run plan: "
                "push it (train without --no-push, or dflashctl push)",
            )
        gpus = [str(g) for g in found["holds"]]
        argv += found.get("pin") or []
    busy = [] if spec.get("force") else conflicts(root, gpus) + queued_ahead(root, gpus, run_id)
    if busy and not spec.get("queue"):
        raise RunError("conflict", "GPUs busy", runs=busy)
    check_interrupt(interrupts)  # the last point where a start is undone
    return gpus, busy


def new_meta(spec, run_id, run_dir, argv, cwd, gpus, busy):
    """The new run's run.json."""
    now = time.time()
    meta = {
        "run_id": run_id,
        "kind": spec.get("kind") or "train",  # train | data (dflashctl data regen)
        "name": spec.get("name"),
        "host": spec.get("host"),
        "argv": argv,
        "cwd": cwd,
        "config": spec.get("config"),
        "overrides": spec.get("overrides", []),
        "payload_hash": spec.get("payload_hash"),
        "gpus": gpus,
        "env": spec.get("env") or {},  # for --resume
        "fork_server_s": spec.get("fork_server_s") or 0,  # hosts.yaml `fork_server:` (forking.py)
        "started_at": utc_iso(now),
        "started_ts": now,
        "run_dir": run_dir,
        "starter": marker(os.getpid()),  # until the supervisor is recorded: see state_of
    }
    if spec.get("group"):
        # One run across several hosts: nodes (host names by rank), this node's rank, rendezvous.
        meta["group"] = spec["group"]
    if spec.get("restart"):
        meta["restart"] = spec["restart"]  # {max, on (exit codes, or None: crashes), delay_s}
    if spec.get("on_event"):
        meta["on_event"] = spec["on_event"]  # argv of the event hook
    if busy:  # --queue: the supervisor waits for the GPUs (FIFO), then starts the trainer
        meta["queued"] = True
        meta["queued_behind"] = [rid for rid, _, _ in busy]
    return meta


def cmd_resume(workdir, selector):
    """Start an ended run again with `--resume` (its newest checkpoint), in its own directory.
    spec `check`: every check a resume makes (pre-flight included), then answer without starting
    (a run across hosts checks every node before any starts)."""
    interrupts = interruptible()
    spec = json.load(sys.stdin)
    root = runs_root(workdir)
    with runs_lock(root) as lock:
        run_id, run_dir, meta = resolve(root, selector)
        group = moved_group(run_id, meta, spec)
        argv, cwd, env = admit_resume(root, run_id, run_dir, meta, spec, interrupts)
        if spec.get("check"):
            emit({"run_id": run_id, "run_dir": run_dir, "pid": None, "gpus": meta.get("gpus"), "checked": True})
            return
        for name in (EXIT, STOP, REASON, AGREED_STOP, SUPERVISED):
            try:
                os.remove(os.path.join(run_dir, name))
            except OSError:
                pass
        now = time.time()
        for key in ("supervisor", "trainer", "pgid"):
            meta.pop(key, None)
        meta["starter"] = marker(os.getpid())
        meta.update(
            argv=argv,
            cwd=cwd,
            env=env,
            payload_hash=spec.get("payload_hash") or meta.get("payload_hash"),
            fork_server_s=spec.get("fork_server_s") or 0,
            resumes=meta.get("resumes", 0) + 1,
            resumed_at=utc_iso(now),
            started_ts=now,
        )
        if group:
            meta["group"] = group
        write_atomic(os.path.join(run_dir, META), json.dumps(meta, indent=2))
        sup = spawn_supervisor(run_dir, meta, env, lock.fileno())
        meta = wait_for_pids(run_dir, sup)
    emit(
        {"run_id": run_id, "run_dir": run_dir, "pid": (meta.get("trainer") or {}).get("pid"), "gpus": meta.get("gpus")}
    )


def admit_resume(root, run_id, run_dir, meta, spec, interrupts):
    """Everything a resume may refuse (a live run, a run that succeeded, another kind, a group
    resumed in part, the pre-flight, busy GPUs, an interrupt): RunError; else the run's (argv, cwd,
    env) to start."""
    refusal = resume_refusal(run_id, meta, state_of(run_dir, meta)[0], spec.get("kind"))
    if refusal is not None:
        raise refusal
    check_group(run_id, meta, spec)
    argv = list(meta["argv"])
    if "--resume" not in argv:
        argv.append("--resume")
    cwd = os.path.realpath(os.path.expanduser(spec["cwd"])) if spec.get("cwd") else meta["cwd"]
    env = spec.get("env") or meta.get("env") or {}
    if spec.get("rdzv_port"):  # the group's rendezvous moves: this node's trainer meets it there
        env = dict(env, MASTER_PORT=str(spec["rdzv_port"]))
    if spec.get("preflight"):
        preflight(argv, cwd, env, interrupts)
    busy = [] if spec.get("force") else conflicts(root, meta.get("gpus") or [])
    if busy:
        raise RunError("conflict", "GPUs busy", runs=busy)
    check_interrupt(interrupts)
    return argv, cwd, env


def check_group(run_id, meta, spec):
    """A run across hosts resumes only as a whole: the client names the group it resumes (spec
    `group`), and it must be the one this node recorded. Refusals are bad input (exit 2)."""
    group, asked = meta.get("group"), spec.get("group")
    if group and not asked:
        raise RunError(
            "usage",
            "run %s spans several hosts: one node alone cannot continue it (dflashctl train %s --resume %s "
            "continues every node)" % (run_id, meta.get("host") or "HOST", run_id),
        )
    if asked and asked != group:
        what = "another group (nodes %s, rank %s)" % (group["nodes"], group["rank"]) if group else "no group"
        raise RunError("usage", "run %s records %s on this host, not the one resumed" % (run_id, what))


def moved_group(run_id, meta, spec):
    """The group with the rendezvous on spec `rdzv_port` (`train --resume --rdzv-port`: rank 0's
    recorded port was taken since), or None when it stays; a run of one host has none to move."""
    port = spec.get("rdzv_port")
    if not port:
        return None
    group = meta.get("group")
    if not group:
        raise RunError("usage", "run %s ran on one host: it has no rendezvous to move (drop --rdzv-port)" % run_id)
    addr = str(group["rendezvous"]).rpartition(":")[0]
    return dict(group, rendezvous="%s:%d" % (addr, int(port)))


def preflight(argv, cwd, env, interrupts):
    """Run the trainer's `--preflight` (config and devices resolved, nothing built); its answer,
    or RunError (config, missing_module, preflight, interrupted) carrying the trainer's one line.
    An interrupt (see interruptible) ends it at once."""
    if not os.path.isdir(cwd):
        raise RunError(
            "preflight", "no trainer in %s: push it first (dflashctl push), or train without --no-push" % cwd
        )
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    try:
        proc = subprocess.Popen(
            argv + ["--preflight"],
            cwd=cwd,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise RunError("preflight", "cannot start the trainer: %s" % exc)
    deadline = time.time() + PREFLIGHT_TIMEOUT_S
    while True:
        try:
            out, err = proc.communicate(timeout=SUPERVISOR_POLL_S)
            break
        except subprocess.TimeoutExpired:
            if interrupts or time.time() > deadline:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                check_interrupt(interrupts)
                raise RunError(
                    "preflight",
                    "the trainer's pre-flight did not answer within %ds (a hung GPU driver?)" % PREFLIGHT_TIMEOUT_S,
                )
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        answer = None
    if isinstance(answer, dict) and answer.get("ok"):
        return answer
    if isinstance(answer, dict) and answer.get("error") in ("config", "missing_module"):
        raise RunError(answer["error"], answer.get("message", ""), module=answer.get("module"))
    last = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    raise RunError(
        "preflight",
        "the trainer's pre-flight failed (exit %d): %s" % (proc.returncode, last[-1] if last else "no output"),
    )


def spawn_supervisor(run_dir, meta, env, lock_fd):
    """Fork the supervisor into its own session; returns its pid. The child never returns."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.close(lock_fd)  # the flock lives on the open file: the child must not keep it held
        os.setsid()
        log = os.open(os.path.join(run_dir, LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # Drop every other inherited descriptor (the SSH channel's pipes above all), so the
        # connection can close and nothing of it keeps the run alive or the run keeps it open.
        os.closerange(3, 65536)
        code = supervise(run_dir, meta, env)
    except BaseException:  # the supervisor must never fall back into the starter's code
        code = 1
    try:
        write_atomic(os.path.join(run_dir, SUPERVISED), "%d\n" % os.getpid())
    except BaseException:
        pass
    os._exit(code)


def wait_for_pids(run_dir, sup_pid, timeout=15.0):
    """Wait until the supervisor has recorded the pids (or died), so the lock covers the start."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        meta = read_json(os.path.join(run_dir, META)) or {}
        if meta.get("supervisor"):
            return meta
        done, _ = os.waitpid(sup_pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    return read_json(os.path.join(run_dir, META)) or {}
