"""Remote side of run management: start detached runs, list, show, stop, and stream logs.

Runs inside the container as `python -c <this source> COMMAND WORKDIR ...` (stdlib only, Python
3.8+). Commands that answer print one JSON object on stdout; `read` streams frames (see
`frame`). Layout of a run: `<workdir>/runs/<run-id>/` with run.json, train.log, metrics.jsonl,
exit_code, stop_request, reason and checkpoints/ (docs/runs.md; several hosts: docs/multihost.md).
"""

import json
import os
import random
import re
import shlex
import signal
import struct
import subprocess
import sys
import time

RUN_DIR_TOKEN = "{run_dir}"
WORKDIR_TOKEN = "{workdir}"
PREFLIGHT_TIMEOUT_S = 300.0  # importing torch and initialising CUDA on every GPU: seconds, not minutes
LOG = "train.log"
ROTATED = "train.log.1"
METRICS = "metrics.jsonl"
EXIT = "exit_code"
STOP = "stop_request"
META = "run.json"
EVAL = "eval.json"  # `dflashctl eval`'s report
LOST_EVENT = ".lost_event"  # exists once the `lost` event was fired
SUPERVISED = ".supervisor_done"  # the supervisor wrote its last byte (after the final hook): a follow may end
REASON = "reason"  # why the run failed, in words, when the trainer knows (a lost node, ...)
LOCK = ".lock"
STARTING_GRACE_S = 60.0  # a run.json without pids is "starting" this long, then "lost"
POLL_S = 0.05  # reader poll period: bounds the added log latency
HEARTBEAT_S = 1.0  # an idle reader writes this often, so it notices a vanished client
SUPERVISOR_POLL_S = 0.2
STEP_RE = re.compile(rb"\bstep[\s=:\[]*(\d+)", re.I)
RUN_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,99}$")


# --- small helpers ---------------------------------------------------------------------------


class RunError(Exception):
    """An answer that is an error: kind (not_found, ambiguous, conflict), message, extra fields."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.answer = dict(error=kind, message=message, **extra)


def emit(obj):
    """Print one JSON answer and flush."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_json(path):
    """A JSON file's content, or None if missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_atomic(path, text):
    """Write via a temp file and rename, so readers never see half a file."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def read_exit_code(run_dir):
    """The recorded exit code, or None while the run has none."""
    try:
        with open(os.path.join(run_dir, EXIT)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def runs_root(workdir):
    """`<workdir>/runs`, with ~ expanded here, inside the container."""
    return os.path.join(os.path.expanduser(workdir), "runs")


def utc_iso(ts):
    """A timestamp as `2026-11-30T11:30:00Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# --- process identity that survives pid reuse ------------------------------------------------


def boot_id():
    """The kernel's boot id (changes on every reboot), or None without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def proc_stat(pid):
    """(state letter, start time in clock ticks) from /proc/<pid>/stat, or None if gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


def marker(pid):
    """pid + kernel start time + boot id: equal markers mean the very same process."""
    stat = proc_stat(pid)
    return {"pid": pid, "start": stat[1] if stat else None, "boot": boot_id()}


def alive(mark):
    """True when the process named by a marker still runs (not a reused pid, not a zombie)."""
    if not mark:
        return False
    if mark.get("boot") and mark["boot"] != boot_id():
        return False
    stat = proc_stat(mark["pid"])
    if stat is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc (not Linux): best effort
            os.kill(mark["pid"], 0)
            return True
        except OSError:
            return False
    return stat[0] not in ("Z", "X") and (mark.get("start") is None or stat[1] == mark["start"])


# --- run state -------------------------------------------------------------------------------


def state_of(run_dir, meta):
    """queued | running | succeeded | failed | stopped | lost, and the exit code if known."""
    code = read_exit_code(run_dir)
    if code is None:
        if meta.get("supervisor") is None:
            # Starting: its starter (runctl start) forks the supervisor. A starter killed before
            # that (kill -9, a client that went away) leaves a run that is lost at once.
            starting = alive(meta["starter"]) if meta.get("starter") else \
                time.time() - meta.get("started_ts", 0) < STARTING_GRACE_S
            return ("running" if starting else "lost"), None
        if alive(meta.get("supervisor")) or alive(meta.get("trainer")):
            # A queued run's supervisor waits for its GPUs; run.json says when it stopped waiting.
            return ("queued" if meta.get("queued") else "running"), None
        code = read_exit_code(run_dir)  # it may have ended between the two reads
        if code is None:
            return "lost", None
    if os.path.exists(os.path.join(run_dir, STOP)):
        return "stopped", code
    return ("succeeded" if code == 0 else "failed"), code


def tail_lines(path, limit=65536):
    """The complete lines in the last `limit` bytes of a file (none if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return []
    # The piece after the last newline is a record still being written: never use it.
    return [ln for ln in data.split(b"\n")[:-1] if ln.strip()]


def last_metrics(run_dir):
    """The latest training record, with the latest acceptance length of any record merged in
    (the trainer logs acceptance on its eval records, whose loss is the held-out one); None before
    the first training record (a progress line of the untrained drafter's eval alone has no step)."""
    merged, trained = {}, False
    for line in tail_lines(os.path.join(run_dir, METRICS)):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("event", "train") == "train":
            trained = True
            merged.update((k, v) for k, v in rec.items() if v is not None)
        else:
            for key in ("acceptance_length", "spec_tau", "spec_tau_prompt_mean"):  # eval records: held-out figures
                if rec.get(key) is not None:
                    merged[key] = rec[key]
    return merged if trained else None


def read_reason(run_dir):
    """The failure reason the trainer recorded (first 2000 characters), or None."""
    try:
        with open(os.path.join(run_dir, REASON), encoding="utf-8", errors="replace") as fh:
            return fh.read(2000).strip() or None
    except OSError:
        return None


def summary(run_dir, meta):
    """What `runs list` shows of one run."""
    state, code = state_of(run_dir, meta)
    ended = None
    try:
        ended = os.stat(os.path.join(run_dir, EXIT)).st_mtime
    except OSError:
        pass
    if state == "lost":
        report_lost(run_dir, meta)
    out = dict(meta)
    out.setdefault("kind", "train")  # run.json from before kinds
    out.update(state=state, exit_code=code, ended_ts=ended, last=last_metrics(run_dir), now_ts=time.time(),
               reason=read_reason(run_dir) if state != "running" else None, eval=eval_figures(run_dir))
    return out


def report_lost(run_dir, meta):
    """The `lost` event, once: nobody is left to notice the loss but whoever looks next (this call)."""
    if not meta.get("on_event"):
        return
    try:
        os.close(os.open(os.path.join(run_dir, LOST_EVENT), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        return  # reported already (or by a concurrent call)
    fire(run_dir, meta, "lost", "lost", log=os.path.join(run_dir, LOG))


def eval_figures(run_dir):
    """The headline of `dflashctl eval`'s report (eval.json), or None before one was made."""
    report = read_json(os.path.join(run_dir, EVAL))
    if not isinstance(report, dict):
        return None
    keys = ("tau", "tau_prompt_mean", "speedup", "identical", "prompts", "max_new_tokens", "device", "temperature")
    figures = {k: report.get(k) for k in keys}
    baseline = report.get("baseline")
    if isinstance(baseline, dict):  # prompt lookup on the same decode path (eval's default)
        figures["baseline"] = {k: baseline.get(k) for k in ("method", "tau", "tau_prompt_mean", "speedup")}
    return figures


def all_runs(root):
    """(run_id, run_dir, meta) for every run, oldest first (run ids sort by start time)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for name in names:
        run_dir = os.path.join(root, name)
        meta = read_json(os.path.join(run_dir, META))
        if isinstance(meta, dict):
            found.append((name, run_dir, meta))
    return found


def resolve(root, selector):
    """The run named by selector: '' = latest, else exact id, unique id prefix, or exact name."""
    runs = all_runs(root)
    if not runs:
        raise RunError("not_found", "no runs yet")
    if not selector:
        return runs[-1]
    exact = [r for r in runs if r[0] == selector]
    if exact:
        return exact[0]
    matches = [r for r in runs if r[0].startswith(selector)] or [r for r in runs if r[2].get("name") == selector]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunError("not_found", "no run matches %r" % selector)
    raise RunError("ambiguous", "%r matches %d runs" % (selector, len(matches)), candidates=[r[0] for r in matches])


# --- start and supervise ---------------------------------------------------------------------


def new_run_id(root):
    """A fresh sortable run id: UTC start time plus 4 random hex digits."""
    while True:
        run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-%04x" % random.getrandbits(16)
        if not os.path.exists(os.path.join(root, run_id)):
            return run_id


def conflicts(root, gpus):
    """Live runs that hold any of these GPUs: [(run_id, name, shared gpus)]."""
    wanted = set(gpus)
    found = []
    for run_id, run_dir, meta in all_runs(root):
        shared = wanted & set(meta.get("gpus") or [])
        if shared and state_of(run_dir, meta)[0] == "running":  # a queued run holds nothing yet
            found.append((run_id, meta.get("name"), sorted(shared)))
    return found


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
        raise RunError("interrupted", "the start was interrupted (signal %d) before the run was created: "
                                      "nothing was started" % interrupts[0])


def remove_unborn(root):
    """Run directories without run.json are what a start killed mid-way (kill -9) left: under the
    start lock no other start is making one, so they go."""
    import shutil

    for name in os.listdir(root):
        path = os.path.join(root, name)
        if RUN_ID_RE.match(name) and os.path.isdir(path) and not os.path.exists(os.path.join(path, META)):
            shutil.rmtree(path, ignore_errors=True)


def cmd_start(workdir):
    """Pre-flight the trainer, check GPUs and start a run under one lock, so concurrent starts
    cannot both win; a failed or interrupted pre-flight or a conflict leaves no run behind, and
    once run.json is written the start completes whatever signal comes."""
    import fcntl
    import shutil

    interrupts = interruptible()
    spec = json.load(sys.stdin)
    root = runs_root(workdir)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remove_unborn(root)
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
        env = spec.get("env") or {}
        os.makedirs(os.path.join(run_dir, "checkpoints"))  # no run.json yet: invisible to list/show
        try:
            if spec.get("config_text") is not None:
                write_atomic(os.path.join(run_dir, spec["config_name"]), spec["config_text"])
            gpus = spec["gpus"]
            if spec.get("preflight"):
                # The program's plan says what the run holds (a remote engine: nothing) and how to
                # pin it there, so the run uses what is locked.
                found = preflight(argv, cwd, env, interrupts)
                gpus = [str(g) for g in found.get("holds", ["cpu"])]
                argv += found.get("pin") or []
            busy = [] if spec.get("force") else conflicts(root, gpus) + queued_ahead(root, gpus, run_id)
            if busy and not spec.get("queue"):
                raise RunError("conflict", "GPUs busy", runs=busy)
            check_interrupt(interrupts)  # the last point where a start is undone
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
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
            "env": env,  # for --resume
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
        write_atomic(os.path.join(run_dir, META), json.dumps(meta, indent=2))
        os.makedirs(meta["cwd"], exist_ok=True)
        sup = spawn_supervisor(run_dir, meta, env, lock.fileno())
        meta = wait_for_pids(run_dir, sup)
    emit({"run_id": run_id, "run_dir": run_dir, "pid": (meta.get("trainer") or {}).get("pid"), "gpus": gpus,
          "queued_behind": meta.get("queued_behind") if meta.get("queued") else None})


def queued_ahead(root, gpus, run_id):
    """Queued runs before run_id (run ids sort by time: FIFO) that want any of these GPUs."""
    wanted = set(gpus)
    found = []
    for rid, run_dir, meta in all_runs(root):
        shared = wanted & set(meta.get("gpus") or [])
        if rid < run_id and shared and state_of(run_dir, meta)[0] == "queued":
            found.append((rid, meta.get("name"), sorted(shared)))
    return found


def wait_in_queue(run_dir, meta, stop_flag):
    """A queued run's supervisor: poll until no running run holds its GPUs and no earlier queued run
    wants them, then leave the queue under the runs lock (so two starts cannot both win).
    False when a stop came first."""
    import fcntl

    root = os.path.dirname(run_dir)
    while True:
        if stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            return False
        with open(os.path.join(root, LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not conflicts(root, meta["gpus"]) and not queued_ahead(root, meta["gpus"], meta["run_id"]):
                update_meta(run_dir, queued=False, dequeued_at=utc_iso(time.time()))
                print("dflashctl: GPUs %s free: starting" % ",".join(meta["gpus"]), flush=True)
                return True
        time.sleep(QUEUE_POLL_S)


def cmd_resume(workdir, selector):
    """Start an ended run again with `--resume` (its newest checkpoint), in its own directory."""
    import fcntl

    interrupts = interruptible()
    spec = json.load(sys.stdin)
    root = runs_root(workdir)
    with open(os.path.join(root, LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run_id, run_dir, meta = resolve(root, selector)
        state, _ = state_of(run_dir, meta)
        if state in ("running", "queued"):
            raise RunError("conflict_running", "run %s is still %s (stop it first: dflashctl runs stop)" % (run_id, state))
        if meta.get("group"):
            raise RunError("bad_request", "run %s spans several hosts: resume it with a new `train` on them" % run_id)
        kind = meta.get("kind", "train")
        if spec.get("kind", kind) != kind:
            how = ["dflashctl", "data", "regen"] if kind == "data" else ["dflashctl", "train"]
            raise RunError("usage", "run %s is a %s run: continue it with %s" % (
                run_id, kind, shlex.join(how + [meta.get("host") or "HOST", "--resume", run_id])))
        argv = list(meta["argv"])
        if "--resume" not in argv:
            argv.append("--resume")
        cwd = os.path.realpath(os.path.expanduser(spec["cwd"])) if spec.get("cwd") else meta["cwd"]
        env = spec.get("env") or meta.get("env") or {}
        if spec.get("preflight"):
            preflight(argv, cwd, env, interrupts)
        busy = [] if spec.get("force") else conflicts(root, meta.get("gpus") or [])
        if busy:
            raise RunError("conflict", "GPUs busy", runs=busy)
        check_interrupt(interrupts)
        for name in (EXIT, STOP, REASON, SUPERVISED):
            try:
                os.remove(os.path.join(run_dir, name))
            except OSError:
                pass
        now = time.time()
        for key in ("supervisor", "trainer", "pgid"):
            meta.pop(key, None)
        meta["starter"] = marker(os.getpid())
        meta.update(argv=argv, cwd=cwd, env=env, payload_hash=spec.get("payload_hash") or meta.get("payload_hash"),
                    resumes=meta.get("resumes", 0) + 1, resumed_at=utc_iso(now), started_ts=now)
        write_atomic(os.path.join(run_dir, META), json.dumps(meta, indent=2))
        sup = spawn_supervisor(run_dir, meta, env, lock.fileno())
        meta = wait_for_pids(run_dir, sup)
    emit({"run_id": run_id, "run_dir": run_dir, "pid": (meta.get("trainer") or {}).get("pid"), "gpus": meta.get("gpus")})


def preflight(argv, cwd, env, interrupts):
    """Run the trainer's `--preflight` (config and devices resolved, nothing built); its answer,
    or RunError (config, missing_module, preflight, interrupted) carrying the trainer's one line.
    An interrupt (see interruptible) ends it at once."""
    if not os.path.isdir(cwd):
        raise RunError("preflight", "no trainer in %s: push it first (dflashctl push), or train without --no-push" % cwd)
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    try:
        proc = subprocess.Popen(argv + ["--preflight"], cwd=cwd, env=child_env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
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
                raise RunError("preflight", "the trainer's pre-flight did not answer within %ds (a hung GPU "
                                            "driver?)" % PREFLIGHT_TIMEOUT_S)
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
    raise RunError("preflight", "the trainer's pre-flight failed (exit %d): %s"
                   % (proc.returncode, last[-1] if last else "no output"))


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


# Exit codes that are never restarted: success, a bad config or data (2), a missing module (4),
# and a stop (130 SIGINT, 143 SIGTERM). Anything else is a crash or a stall (docs/runs.md).
NO_RESTART = (0, 2, 4, 130, 143)
RESTART_DELAY_CAP_S = 300.0
QUEUE_POLL_S = 1.0  # how often a queued run looks whether its GPUs are free
HOOK_WAIT_S = 30.0  # how long the supervisor waits for the last event's hook before it exits


def supervise(run_dir, meta, env):
    """Run the trainer, honour stop requests, restart it from its newest checkpoint after a crash
    when the run asked for restarts, and record its exit code (128+N for signal N)."""
    stop_flag = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop_flag.append(1))
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    child_env["DFLASHCTL_REASON_FILE"] = os.path.join(run_dir, REASON)
    restart = meta.get("restart") or {}
    argv, failed_at, attempt = list(meta["argv"]), None, 0
    if meta.get("queued"):
        update_meta(run_dir, supervisor=marker(os.getpid()))
        print("dflashctl: queued behind %s for GPUs %s" % (", ".join(meta.get("queued_behind") or []),
                                                          ",".join(meta["gpus"])), flush=True)
        if not wait_in_queue(run_dir, meta, stop_flag):
            print("dflashctl: the queued run was cancelled before it started", flush=True)
            write_atomic(os.path.join(run_dir, EXIT), "%d\n" % (128 + signal.SIGTERM))
            wait_hook(fire(run_dir, meta, "stopped", "stopped", 128 + signal.SIGTERM))
            return 0
    while True:
        attempt += 1
        log_from = os.fstat(1).st_size  # where this attempt's output starts (stdout is the log)
        try:
            child = subprocess.Popen(argv, cwd=meta["cwd"], env=child_env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        except OSError as exc:
            sys.stderr.write("dflashctl: cannot start the trainer: %s\n" % exc)
            sys.stderr.flush()
            update_meta(run_dir, supervisor=marker(os.getpid()))
            write_atomic(os.path.join(run_dir, EXIT), "127\n")
            return 0
        update_meta(run_dir, supervisor=marker(os.getpid()), trainer=marker(child.pid), pgid=child.pid)
        fire(run_dir, meta, "restarted" if attempt > 1 else "started", "running")
        code = wait_trainer(run_dir, child, stop_flag)
        step = newest_checkpoint(run_dir)
        done = (read_json(os.path.join(run_dir, META)) or {}).get("restarts", 0)
        if not wants_restart(restart, code, done) or stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            break
        if step is not None and step == failed_at:
            print("dflashctl: the trainer failed again (exit %d) without getting past its checkpoint at step %s: "
                  "not restarting" % (code, step), flush=True)
            break
        failed_at = step
        delay = min(RESTART_DELAY_CAP_S, float(restart.get("delay_s", 10)) * 2 ** done)
        print("dflashctl: restart %d/%d after exit code %d, from %s, in %g s" % (
            done + 1, restart["max"], code, "the checkpoint at step %s" % step if step is not None else "the start",
            delay), flush=True)
        update_meta(run_dir, restarts=done + 1, last_restart={"exit_code": code, "checkpoint": step, "at": utc_iso(time.time())})
        if sleep_unless_stopped(run_dir, delay, stop_flag):
            break
        if step is not None and "--resume" not in argv:
            argv.append("--resume")
    if code not in (0, 2) and meta.get("host") and meta.get("kind") == "data":
        # A regen keeps every row it wrote: --resume goes on at the first missing one.
        command = shlex.join(["dflashctl", "data", "regen", meta["host"], "--resume", meta["run_id"]])
        print("dflashctl: regen exited with %d; continue where it stopped: %s" % (code, command), flush=True)
    elif code not in (0, 2) and meta.get("host") and not meta.get("group") and newest_checkpoint(run_dir) is not None:
        # The trainer's own hint names its flag; this one names the command that does it here.
        command = shlex.join(["dflashctl", "train", meta["host"], "--resume", meta["run_id"]])
        print("dflashctl: the trainer exited with %d; continue from its newest checkpoint: %s" % (code, command),
              flush=True)
    if code != 0 and read_reason(run_dir) is None and not os.path.exists(os.path.join(run_dir, STOP)):
        line = error_line(os.path.join(run_dir, LOG), log_from)
        if line:  # `runs show` says why it failed without a look into the log
            write_atomic(os.path.join(run_dir, REASON), line + "\n")
    write_atomic(os.path.join(run_dir, EXIT), "%d\n" % code)
    state = state_of(run_dir, read_json(os.path.join(run_dir, META)) or meta)[0]
    wait_hook(fire(run_dir, meta, state, state, code))
    return 0


def error_line(log_path, start):
    """The trainer's last `error: ...` line in the log from byte `start` on (its last 64 kB), else
    the last line of a Python traceback there; None if neither."""
    try:
        with open(log_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(start if start <= size else 0, size - 65536))
            lines = [ln.decode("utf-8", "replace").strip() for ln in fh.read().splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if errors:
        return errors[-1][len("error: "):][:2000]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        last = [ln for ln in lines if not ln.startswith("dflashctl: ")]
        return last[-1][:2000] if last else None
    return None


def wait_hook(hook):
    """The last event: give its hook HOOK_WAIT_S to report before the supervisor goes (and a
    follow ends: it waits for SUPERVISED)."""
    if hook is not None:
        try:
            hook.wait(timeout=HOOK_WAIT_S)
        except subprocess.TimeoutExpired:
            pass


def fire(run_dir, meta, event, state, code=None, log=None):
    """Run the run's event hook, if it has one, with what happened in its environment; never
    through a shell, never waited for here (the caller may). Its output goes to the run's log
    (the supervisor's stdout is the log; `log` names it for a caller whose stdout is not)."""
    argv = meta.get("on_event")
    if not argv:
        return None
    env = dict(os.environ, DFLASHCTL_EVENT=event, DFLASHCTL_RUN_ID=meta["run_id"], DFLASHCTL_RUN_NAME=meta.get("name") or "",
               DFLASHCTL_STATE=state, DFLASHCTL_EXIT_CODE="" if code is None else str(code),
               DFLASHCTL_HOST=meta.get("host") or "", DFLASHCTL_RUN_DIR=run_dir)
    note = "dflashctl: event %s\n" % event
    out = open(log, "ab") if log else None  # never this process's stdout there: it carries the answer
    try:
        if out:
            out.write(note.encode())
            out.flush()
        else:
            sys.stdout.write(note)
            sys.stdout.flush()
        return subprocess.Popen(argv, cwd=run_dir, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                stdout=out, stderr=out, close_fds=True)
    except OSError as exc:
        if not out:
            print("dflashctl: the event hook cannot start: %s" % exc, flush=True)
        return None
    finally:
        if out:
            out.close()


def wants_restart(restart, code, done):
    """Whether a run that asked for restarts gets one more after this exit code."""
    if not restart or done >= restart.get("max", 0):
        return False
    listed = restart.get("on")
    return code in listed if listed else code not in NO_RESTART


def newest_checkpoint(run_dir):
    """The step of the run's newest complete checkpoint (hidden entries are half-written), or None."""
    try:
        names = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if not n.startswith(".")]
    except OSError:
        return None
    steps = [checkpoint_key(n)[0] for n in names]
    steps = [s for s in steps if s >= 0]
    return max(steps) if steps else None


def sleep_unless_stopped(run_dir, seconds, stop_flag):
    """Wait out a restart delay; True when a stop came meanwhile (the run then ends as it stood)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if stop_flag or os.path.exists(os.path.join(run_dir, STOP)):
            return True
        time.sleep(SUPERVISOR_POLL_S)
    return False


def wait_trainer(run_dir, child, stop_flag):
    """Wait for the trainer; on a stop request SIGTERM the trainer, then SIGKILL its group after the
    grace. Only the trainer gets SIGTERM: its helpers (the compiler's ptxas and workers, warm-up or
    rank processes it stops itself) must not die under it while it winds down, or it logs their
    failure (a whole PTX dump for a ptxas killed mid-compile)."""
    kill_at = None
    while True:
        try:
            rc = child.wait(timeout=SUPERVISOR_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if stop_flag and not os.path.exists(os.path.join(run_dir, STOP)):
            request_stop(run_dir, 60.0, "signal to supervisor")
        req = read_json(os.path.join(run_dir, STOP))
        if req is not None and kill_at is None:
            signal_process(child.pid, signal.SIGTERM)
            kill_at = time.time() + float(req.get("grace", 60))
        elif kill_at is not None and time.time() >= kill_at:
            signal_group(child.pid, signal.SIGKILL)
            kill_at = float("inf")
    # Leftovers of the trainer's group (compiler workers...) must not hold the GPUs.
    signal_group(child.pid, signal.SIGKILL)
    return rc if rc >= 0 else 128 - rc


def signal_group(pgid, sig):
    """Signal a process group, ignoring one that is already gone."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def signal_process(pid, sig):
    """Signal one process, ignoring one that is already gone."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def request_stop(run_dir, grace, reason):
    """Record a stop request; the supervisor acts on it."""
    write_atomic(os.path.join(run_dir, STOP), json.dumps({"grace": grace, "at": utc_iso(time.time()), "by": reason}))


def update_meta(run_dir, **fields):
    """Merge fields into run.json (atomically)."""
    path = os.path.join(run_dir, META)
    meta = read_json(path) or {}
    meta.update(fields)
    write_atomic(path, json.dumps(meta, indent=2))


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


# --- list / show / stop ----------------------------------------------------------------------


def cmd_list(workdir):
    """Every run's summary, oldest first."""
    emit({"runs": [summary(d, m) for _, d, m in all_runs(runs_root(workdir))]})


def cmd_show(workdir, selector, max_points="1000"):
    """One run's summary plus its metrics, thinned to at most max_points records (0: none)."""
    _, run_dir, meta = resolve(runs_root(workdir), selector)
    if int(max_points) <= 0:
        out = summary(run_dir, meta)
        out.update(metrics=[], metrics_count=0)
        emit(out)
        return
    records = []
    try:
        with open(os.path.join(run_dir, METRICS), "rb") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a half-written last line
                if isinstance(rec, dict):
                    records.append(rec)
    except OSError:
        pass
    # Thin only the training records: eval records are few, and a fixed stride could skip all of them.
    is_train = [r.get("event", "train") == "train" for r in records]
    stride = max(1, -(-sum(is_train) // int(max_points)))
    train_idx = [i for i, t in enumerate(is_train) if t]
    keep = set(train_idx[::stride] + train_idx[-1:])
    thinned = [r for i, r in enumerate(records) if i in keep or not is_train[i]]
    out = summary(run_dir, meta)
    out.update(metrics=thinned, metrics_count=len(records))
    emit(out)


def cmd_stop(workdir, selector, grace):
    """Ask the supervisor to stop the run and wait until it has ended."""
    grace = float(grace)
    _, run_dir, meta = resolve(runs_root(workdir), selector)
    state, _ = state_of(run_dir, meta)
    if state not in ("running", "queued"):
        out = summary(run_dir, meta)
        out["already"] = True
        emit(out)
        return
    if not os.path.exists(os.path.join(run_dir, STOP)):
        request_stop(run_dir, grace, "dflashctl runs stop")
    if meta.get("trainer") and not alive(meta.get("supervisor")):
        stop_orphan_trainer(run_dir, meta, grace)
    deadline = time.time() + grace + 30
    while time.time() < deadline and read_exit_code(run_dir) is None and state_of(run_dir, meta)[0] in ("running", "queued"):
        time.sleep(0.1)
    meta = read_json(os.path.join(run_dir, META)) or meta
    emit(summary(run_dir, meta))


def stop_orphan_trainer(run_dir, meta, grace):
    """The supervisor is gone but the trainer lives: do its job (the exit code is unknowable)."""
    trainer = meta.get("trainer")
    signal_process(trainer["pid"], signal.SIGTERM)  # the trainer only, as wait_trainer does
    deadline = time.time() + grace
    while alive(trainer) and time.time() < deadline:
        time.sleep(0.1)
    code = 128 + signal.SIGKILL if alive(trainer) else 128 + signal.SIGTERM
    signal_group(meta.get("pgid") or trainer["pid"], signal.SIGKILL)  # and whatever is left of its group
    write_atomic(os.path.join(run_dir, EXIT), "%d\n" % code)


# --- log reader ------------------------------------------------------------------------------
#
# Frames: 1 type byte + 4-byte big-endian length + payload. Types:
#   S start {run_id, inode, offset}   D log bytes (in order; the client adds up the offset)
#   R rotated {inode}: what follows starts at offset 0 of that file
#   M latest metrics record (JSON)    H heartbeat (empty)
#   E end {state, exit_code}          X error {error, message, candidates?}


def frame(kind, payload=b""):
    """Write one frame to stdout unbuffered (SIGPIPE is default: a vanished client ends us)."""
    if not isinstance(payload, bytes):
        payload = json.dumps(payload).encode()
    view = memoryview(kind + struct.pack(">I", len(payload)) + payload)
    while view:
        view = view[os.write(1, view):]


def start_offset(path, lines, since_step):
    """Where a tail starts: first line with step >= since_step, else the last `lines` lines (<0: all)."""
    if lines < 0 and since_step is None:
        return 0
    try:
        fh = open(path, "rb")
    except OSError:
        return 0
    with fh:
        if since_step is not None:
            pos = 0
            for line in fh:
                m = STEP_RE.search(line)
                if m and int(m.group(1)) >= since_step:
                    return pos
                pos += len(line)
            return pos
        fh.seek(0, os.SEEK_END)
        end = pos = fh.tell()
        if lines == 0:
            return end
        found = 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
            if pos + step == end and block.endswith(b"\n"):
                block = block[:-1]  # the final newline does not start a line
            for i in range(len(block) - 1, -1, -1):
                if block[i:i + 1] == b"\n":
                    found += 1
                    if found == lines:
                        return pos + i + 1
        return 0


def open_at(run_dir, inode, offset, lines, since_step):
    """Open the log where the client left off (inode + offset), or at the tail's start."""
    for name in (LOG, ROTATED):
        path = os.path.join(run_dir, name)
        try:
            fh = open(path, "rb")
        except OSError:
            continue
        st = os.fstat(fh.fileno())
        if inode is None and name == LOG:
            fh.seek(start_offset(path, lines, since_step))
            return fh, st.st_ino
        if inode is not None and st.st_ino == inode and st.st_size >= offset:
            fh.seek(offset)
            return fh, st.st_ino
        fh.close()
    return None, None


def cmd_read(workdir, selector, inode, offset, lines, since_step, follow, metrics):
    """Stream the log (and, if asked, the latest metrics) as frames until the run ends."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    run_id, run_dir, meta = resolve(runs_root(workdir), selector)
    inode = int(inode) if inode else None
    fh, ino = open_at(run_dir, inode, int(offset or 0), int(lines), int(since_step) if since_step else None)
    if fh is None and inode is not None:
        # The file the client was reading is gone (rotated twice): restart on the current log.
        fh, ino = open_at(run_dir, None, 0, -1, None)
    frame(b"S", {"run_id": run_id, "inode": ino, "offset": fh.tell() if fh else 0})
    stream_log(run_dir, meta, fh, ino, follow == "1", metrics == "1")


def stream_log(run_dir, meta, fh, ino, follow, metrics):
    """The reader loop: send what the log gains, switch files on rotation, end with the run."""
    log_path = os.path.join(run_dir, LOG)
    parent = os.getppid()
    last_write = time.time()
    metrics_size = -1
    while True:
        if fh is None:  # the supervisor has not created the log yet
            try:
                fh = open(log_path, "rb")
                ino = os.fstat(fh.fileno()).st_ino
                frame(b"R", {"inode": ino})
            except OSError:
                pass
        chunk = fh.read(65536) if fh else b""
        if chunk:
            frame(b"D", chunk)
            last_write = time.time()
            continue
        if fh is not None:
            switched = follow_rotation(fh, ino, log_path)
            if switched:
                fh, ino = switched
                continue
        if metrics:
            metrics_size = send_metrics(run_dir, metrics_size)
        if not follow or (state_of(run_dir, meta)[0] not in ("running", "queued") and supervised(run_dir)):
            if fh is not None and fh.read(1):  # the last lines arrived after our read: drain first
                fh.seek(-1, os.SEEK_CUR)
                continue
            state, code = state_of(run_dir, meta)
            frame(b"E", {"state": state, "exit_code": code})
            return
        if time.time() - last_write >= HEARTBEAT_S:
            if os.getppid() != parent:  # whoever started us is gone: nobody is listening
                return
            frame(b"H")
            last_write = time.time()
        time.sleep(POLL_S)


def supervised(run_dir):
    """True once nothing more will be written to the run's log by its supervisor: it said it is
    done (after the final event hook), or it is gone (killed, or a run from before SUPERVISED)."""
    if os.path.exists(os.path.join(run_dir, SUPERVISED)):
        return True
    return not alive((read_json(os.path.join(run_dir, META)) or {}).get("supervisor"))


def follow_rotation(fh, ino, log_path):
    """After EOF: a new train.log (renamed away) or a truncated one means switch or restart."""
    try:
        st = os.stat(log_path)
    except OSError:
        return None  # renamed, the new one not created yet
    if st.st_ino != ino:
        if fh.read(1):  # finish the old file first
            fh.seek(-1, os.SEEK_CUR)
            return None
        fh.close()
        new = open(log_path, "rb")
        ino = os.fstat(new.fileno()).st_ino
        frame(b"R", {"inode": ino})
        return new, ino
    if st.st_size < fh.tell():  # truncated in place (copytruncate)
        fh.seek(0)
        frame(b"R", {"inode": ino})
        return fh, ino
    return None


def send_metrics(run_dir, known_size):
    """Send the latest metrics when metrics.jsonl changed; returns its size now."""
    path = os.path.join(run_dir, METRICS)
    try:
        size = os.stat(path).st_size
    except OSError:
        return known_size
    if size != known_size:
        record = last_metrics(run_dir)
        if record:
            frame(b"M", record)
    return size


# --- pack: a run's files as a tar stream (`dflashctl runs pull`) -----------------------------

CHECKPOINT_CHOICES = ("none", "latest", "all")


def checkpoint_key(name):
    """Sort key of a checkpoint entry: its step number (step_00000012, step-12.json), then name."""
    digits = re.findall(r"\d+", name)
    return (int(digits[-1]) if digits else -1, name)


def pack_list(run_dir, checkpoints):
    """(archive name, path, size) of the run's regular files, checkpoints/ as chosen; links skipped."""
    found = []
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    keep = None  # checkpoint entries to include (None: all)
    if checkpoints == "latest":
        entries = sorted((e for e in os.listdir(ckpt_dir) if not e.startswith(".")), key=checkpoint_key) \
            if os.path.isdir(ckpt_dir) else []
        keep = set(entries[-1:])
    for top, dirs, files in os.walk(run_dir):
        rel_top = os.path.relpath(top, run_dir)
        if rel_top == ".":
            if checkpoints == "none" and "checkpoints" in dirs:
                dirs.remove("checkpoints")
        elif rel_top == "checkpoints":
            dirs[:] = [d for d in dirs if not d.startswith(".") and (keep is None or d in keep)]
            files = [f for f in files if not f.startswith(".") and (keep is None or f in keep)]
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.normpath(os.path.join(rel_top, name))
            found.append((rel, path, os.path.getsize(path)))
    return found


def cmd_pack(workdir, selector, checkpoints="none"):
    """One JSON header line (run id, state, file count, bytes), then the run's files as a tar on stdout."""
    import tarfile

    if checkpoints not in CHECKPOINT_CHOICES:
        raise RunError("bad_request", "checkpoints must be one of %s" % ", ".join(CHECKPOINT_CHOICES))
    run_id, run_dir, meta = resolve(runs_root(workdir), selector)
    files = pack_list(run_dir, checkpoints)
    emit({"run_id": run_id, "state": state_of(run_dir, meta)[0], "files": len(files),
          "bytes": sum(size for _, _, size in files)})
    out = sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, size in files:
            info = tar.gettarinfo(path, arcname=rel)
            info.size = size  # as counted in the header: a log that grew since is cut there
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    out.flush()


COMMANDS = {"start": cmd_start, "resume": cmd_resume, "list": cmd_list, "show": cmd_show, "stop": cmd_stop, "read": cmd_read,
            "pack": cmd_pack}


def main(argv):
    """Dispatch `COMMAND ARGS...`; error answers go to stdout as JSON (or an X frame)."""
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write("usage: runctl {%s} WORKDIR ...\n" % ",".join(COMMANDS))
        return 2
    try:
        COMMANDS[argv[0]](*argv[1:])
    except RunError as exc:
        # Answered on stdout (exit 0): the client turns `error` into its own exceptions.
        if argv[0] == "read":
            frame(b"X", exc.answer)
        else:
            emit(exc.answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
