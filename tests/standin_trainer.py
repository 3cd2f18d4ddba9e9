"""Stand-in for the DFlash trainer in run-lifecycle tests: same command line, no torch.

Installed by the tests as `<workdir>/payload/dflash_train/__main__.py`, so `python -m dflash_train
--config FILE --set key=value ...` runs it exactly as it would run the real trainer. Keys:
  run.output_dir        where metrics.jsonl and checkpoints/ go (set by dflashctl)
  run.steps             number of steps (default 20)
  standin.step_time     seconds per step (default 0.05)
  standin.fail_at       exit with standin.fail_code (default 3) at that step
  standin.fail_error    at standin.fail_at, also print `error: <this>` to stderr, as the trainer does
  standin.ignore_sigterm  true: print that SIGTERM was ignored and keep going
  standin.lines         log lines per step (default 1)
  standin.fail_once      true: fail at standin.fail_at only the first time (a marker file in run.output_dir)
  standin.checkpoint_every  write a fake checkpoint every N steps (default: only on SIGTERM)
  standin.preflight_error  --preflight answers this config error (exit 2), as the trainer does
  standin.preflight_v1  true: --preflight answers as a trainer from before the run plan did (a `gpus` key)
  standin.preflight_signal  --preflight sends this signal (INT, TERM) to its parent, runctl start, as a
                        Ctrl-C during a slow pre-flight would, then hangs until it is killed
  standin.preflight_signal_client  the same, but to the client above runctl start (local transport; the
                        exec guard that runs runctl is passed over)
  standin.preflight_signal_cli  the same, to the dflashctl CLI process whose command line holds this
                        setting and standin.tag (found in /proc: over SSH the client is no ancestor; the
                        test's sshd runs here)
  standin.tag           any text; with one unique to the test, the *_signal_cli keys reach its CLI alone
  standin.start_signal_cli  the same, from a child of the trainer once the CLI follows the run's log
                        (a reader of this run exists), and the trainer trains on
  standin.hold_at       after that step, wait until run.output_dir/standin-release exists (or SIGTERM
                        comes): a test acts on a running run, however slow the machine, then releases it
  standin.helper        true: start a helper process in the trainer's process group (as the compiler
                        runs ptxas) that logs any SIGTERM it gets; after its own SIGTERM the stand-in
                        then waits 0.5 s before it checkpoints, as a trainer does while a compile ends
  standin.visible_gpus  how many GPUs the stand-in's pre-flight pretends to see (default 0): a host with GPUs
--preflight prints the trainer's one-line JSON answer ({"ok": true, "holds": [...], "pin": [...], ...}:
what the run holds from run.gpus, run.device=cuda:N or cpu, else every visible GPU, pinned by `pin`);
--resume starts after the newest fake checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time

# The helper: logs a SIGTERM (which the real compiler's ptxas would die of, mid-compile) and exits.
HELPER = (
    "import os, signal, time\n"
    "def term(*_):\n"
    "    print('standin helper: got SIGTERM while the trainer was still running', flush=True)\n"
    "    os._exit(1)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "print('standin: helper pid %d' % os.getpid(), flush=True)\n"
    "time.sleep(3600)\n"
)


def parse(argv):
    """--config FILE (read as `key: value` lines) and --set key=value pairs, later ones winning."""
    opts = {"run.steps": "20", "standin.step_time": "0.05", "standin.fail_code": "3", "standin.lines": "1"}
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            with open(next(it)) as fh:
                for line in fh:
                    key, sep, value = line.partition(":")
                    if sep and value.strip():
                        opts[key.strip()] = value.strip()
        elif arg == "--set":
            key, _, value = next(it).partition("=")
            opts[key] = value
    return opts


def parent(pid):
    """The parent of pid (field 4 of its stat)."""
    with open("/proc/%d/stat" % pid) as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def cmdline(pid):
    """pid's command line, NUL-separated (b'' once it is gone)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def signal_cli(opts, key):
    """Send the signal named by setting `key` to the dflashctl CLI whose command line holds `key=VALUE`
    and this trainer's `standin.tag`: with a tag unique to the test, that CLI alone (not the same
    test's CLI in another suite running on this machine)."""
    settings = [("%s=%s" % (k, opts[k])).encode() for k in (key, "standin.tag") if k in opts]
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        words = cmdline(pid).split(b"\0")
        if all(s in words for s in settings) and any(b"dflashctl.cli" in w for w in words):
            os.kill(pid, getattr(signal, "SIG" + opts[key]))


def signal_cli_once_followed(opts, key):
    """signal_cli, from a child, once a log reader of this run exists (the CLI knows the run then and
    follows it): one defined point for the Ctrl-C, whatever the machine's speed; the wait is bounded."""
    run_id = os.path.basename(os.path.normpath(opts.get("run.output_dir", "."))).encode()
    if os.fork():
        return
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        b"read" in words and run_id in words
        for words in (cmdline(int(p)).split(b"\0") for p in os.listdir("/proc") if p.isdigit())
    ):
        time.sleep(0.05)
    signal_cli(opts, key)
    os._exit(0)


def main():
    """Train (pretend), honouring SIGTERM like the real trainer: checkpoint and exit 143."""
    opts = parse(sys.argv[1:])
    if "--preflight" in sys.argv:
        if opts.get("standin.preflight_error"):
            print(json.dumps({"ok": False, "error": "config", "message": opts["standin.preflight_error"]}), flush=True)
            return 2
        if opts.get("standin.preflight_signal"):
            os.kill(os.getppid(), getattr(signal, "SIG" + opts["standin.preflight_signal"]))
            time.sleep(3600)
        if opts.get("standin.preflight_signal_client"):
            client = parent(os.getppid())
            if b"<this source> run TOKEN" in cmdline(client):  # runctl runs under the guard (dflashctl/guard.py)
                client = parent(client)
            os.kill(client, getattr(signal, "SIG" + opts["standin.preflight_signal_client"]))
            time.sleep(3600)
        if opts.get("standin.preflight_signal_cli"):
            signal_cli(opts, "standin.preflight_signal_cli")
            time.sleep(3600)
        if opts.get("standin.preflight_v1"):  # what a trainer from before the run plan answered
            print(json.dumps({"ok": True, "devices": ["cpu"], "gpus": [], "summary": ["standin"]}), flush=True)
            return 0
        holds, pin = preflight_holds(opts)
        devices = ["cuda:%s" % g for g in holds if g != "cpu"] or ["cpu"]
        print(
            json.dumps(
                {"ok": True, "holds": holds, "pin": pin, "devices": devices, "summary": ["standin"], "plan": {}}
            ),
            flush=True,
        )
        return 0
    if opts.get("standin.start_signal_cli"):
        signal_cli_once_followed(opts, "standin.start_signal_cli")
    out = opts.get("run.output_dir", ".")
    steps = int(opts["run.steps"])
    step_time = float(opts["standin.step_time"])
    fail_at = int(opts.get("standin.fail_at", -1))
    marker = os.path.join(out, "standin-failed-once")
    if flag(opts, "standin.fail_once") and os.path.exists(marker):
        fail_at = -1
    every = int(opts.get("standin.checkpoint_every", 0))
    hold_at = int(opts.get("standin.hold_at", -1))
    ignore = flag(opts, "standin.ignore_sigterm")
    state = {"step": 0, "term": False}

    def on_term(signum, frame):
        if ignore:
            print("standin: ignoring SIGTERM", flush=True)
        else:
            state["term"] = True

    signal.signal(signal.SIGTERM, on_term)
    print("standin: pid %d, %d steps, output %s" % (os.getpid(), steps, out), flush=True)
    helper = flag(opts, "standin.helper")
    if helper:
        subprocess.Popen([sys.executable, "-c", HELPER])  # inherits the process group and the log
    first = 1 + (latest_checkpoint(out) if "--resume" in sys.argv else 0)
    if first > 1:
        print("standin: resuming after step %d" % (first - 1), flush=True)
    with open(os.path.join(out, "metrics.jsonl"), "a") as metrics:
        for step in range(first, steps + 1):
            if state["term"]:
                if helper:
                    time.sleep(0.5)
                return checkpoint(out, state["step"])
            time.sleep(step_time)
            state["step"] = step
            loss = 5.0 / (1 + 0.1 * step)
            for i in range(int(opts["standin.lines"])):
                print("step %d/%d loss %.4f line %d" % (step, steps, loss, i), flush=True)
            record = {
                "step": step,
                "total_steps": steps,
                "loss": loss,
                "acceptance_length": 1 + step / steps * 3,
                "lr": 6e-4,
                "grad_norm": 1.0,
                "tokens_per_s": 1000.0,
                "step_time_s": step_time,
                "gpu_mem_gb": 0.0,
            }
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if every and step % every == 0:
                save(out, step)
            if step == hold_at:
                print("standin: holding after step %d" % step, flush=True)
                while not os.path.exists(os.path.join(out, "standin-release")) and not state["term"]:
                    time.sleep(0.05)
            if step == fail_at:
                open(marker, "w").close()
                print("standin: failing at step %d" % step, file=sys.stderr, flush=True)
                if opts.get("standin.fail_error"):
                    print("error: %s" % opts["standin.fail_error"], file=sys.stderr, flush=True)
                return int(opts["standin.fail_code"])
    print("standin: done", flush=True)
    return 0


def flag(opts, key):
    """A true/false option (1, true or yes is true; unset is false)."""
    return opts.get(key, "false").lower() in ("1", "true", "yes")


def preflight_holds(opts):
    """(what the run holds, the argv that pins it) as the real trainer's plan has them: run.gpus,
    run.device=cuda:N or cpu as set, else every visible GPU (standin.visible_gpus), else the CPU."""
    if opts.get("run.gpus"):
        return [str(int(g)) for g in opts["run.gpus"].strip("[]").split(",") if g.strip()], []
    device = opts.get("run.device", "auto")
    if device.startswith("cuda:"):
        return [str(int(device.split(":")[1]))], []
    visible = [str(g) for g in range(int(opts.get("standin.visible_gpus", "0")))]
    if device == "auto" and visible:
        return visible, ["--set", "run.gpus=[%s]" % ",".join(visible)]
    return ["cpu"], []


def latest_checkpoint(out):
    """The step of the newest fake checkpoint, 0 without one."""
    try:
        names = os.listdir(os.path.join(out, "checkpoints"))
    except OSError:
        return 0
    return max([int(n[5:-5]) for n in names if n.startswith("step-") and n.endswith(".json")] or [0])


def save(out, step):
    """Write a fake checkpoint for step."""
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    with open(os.path.join(out, "checkpoints", "step-%d.json" % step), "w") as fh:
        json.dump({"step": step}, fh)


def checkpoint(out, step):
    """Write a fake checkpoint and return the exit code for death by SIGTERM."""
    save(out, step)
    print("standin: SIGTERM, checkpoint saved at step %d" % step, flush=True)
    return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
