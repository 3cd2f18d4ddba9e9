"""Parallel compile warm-up (warmup.py), tested on the CPU: the decision, the launcher with
children that succeed, fail, hang past the timeout or are stopped, and the trainer around it
(threads start regardless; SIGTERM during the warm-up exits 143 at once). One slow test checks
that the threads' compile really comes from the cache the warm-up process filled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train import warmup as WU
from dflash_train.config import load_config
from dflash_train.plan import parallel_warmup_decision, resolve_run

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"
PY = sys.executable


@pytest.mark.parametrize(
    "setting, devices, compile_mode, expected, why",
    [
        ("auto", ["cuda:0", "cuda:1"], "default", "on", "2 GPUs and compile default"),
        ("auto", ["cuda:0"], "cudagraphs", "off", "one device"),
        ("auto", ["cuda:0", "cuda:0"], "default", "off", "one device"),
        ("auto", ["cpu", "cpu"], "default", "off", "one device"),
        ("auto", ["cuda:0", "cuda:1"], "off", "off", "nothing to compile"),
        ("on", ["cpu"], "default", "on", "one process per device (cpu)"),
        ("on", ["cuda:0", "cuda:1"], "off", "off", "nothing to compile"),
        ("off", ["cuda:0", "cuda:1"], "default", "off", "one after another"),
    ],
)
def test_the_decision_and_its_reason(setting, devices, compile_mode, expected, why):
    value, reason = parallel_warmup_decision(setting, devices, compile_mode)
    assert value == expected and why in reason


def test_the_decision_is_printed_with_the_other_start_up_decisions(tmp_path):
    plan = resolve_run(load_config(overrides=["run.compile=default", "run.threads=2", f"run.output_dir={tmp_path}"]))
    cfg, notes = plan.cfg, plan.notes
    assert cfg.run.parallel_warmup == "off"
    assert "parallel warm-up: off (one device: nothing to compile in parallel)" in notes
    quiet = resolve_run(load_config(), cuda_count=0).notes  # the CPU default compiles nothing: no warm-up line at all
    assert not any("parallel warm-up" in n for n in quiet)


def job(tmp_path: Path, name: str, code: str) -> WU.Job:
    return WU.Job(name, [PY, "-c", code], tmp_path / f"{name}.log")


def test_ok_failed_and_hung_children_each_end_with_their_reason(tmp_path):
    # Two calls, so no outcome depends on speed: the first one's timeout only bounds a hang (it ends
    # once both children have), the second one's child can never finish before its 1 s.
    done = WU.run_jobs(
        [
            job(tmp_path, "good", "print('compiled')"),
            job(tmp_path, "bad", "import sys; print('RuntimeError: no kernel image'); sys.exit(3)"),
        ],
        timeout_s=120,
        should_stop=lambda: False,
    )
    hung = WU.run_jobs(
        [job(tmp_path, "stuck", "import time; time.sleep(600)")], timeout_s=1.0, should_stop=lambda: False
    )
    results = done + hung
    assert [r.status for r in results] == ["ok", "failed", "timed out"]
    assert results[1].reason.startswith("exit 3: RuntimeError: no kernel image (log: ")
    assert "still running after 1 s, killed (run.warmup_timeout_s" in results[2].reason
    assert results[2].line().startswith("parallel warm-up: stuck timed out after ")
    assert (tmp_path / "good.log").read_text() == "compiled\n"


def test_a_stop_kills_every_child_at_once(tmp_path):
    pid_file = tmp_path / "pid"
    # The pid appears at once (a rename), so the stop comes once child a runs: not after a fixed
    # time, before which a busy machine may not have started it yet.
    code = (
        f"import os, time; open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
        f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(600)"
    )
    results = WU.run_jobs(
        [job(tmp_path, "a", code), job(tmp_path, "b", "import time; time.sleep(600)")],
        timeout_s=600,
        should_stop=pid_file.exists,
    )
    assert [r.status for r in results] == ["stopped", "stopped"]
    with pytest.raises(ProcessLookupError):  # killed and reaped: no orphan keeps compiling
        os.kill(int(pid_file.read_text()), 0)


def test_one_job_per_distinct_device_named_for_its_first_worker(tmp_path):
    jobs = WU.jobs_for(["cuda:0", "cuda:1", "cuda:1"], tmp_path / "c.yaml", tmp_path / "logs", 60)
    assert [j.name for j in jobs] == ["cuda:0", "cuda:1"]
    assert jobs[1].argv[1:] == [
        "-m",
        "dflash_train.warmup",
        "--config",
        str(tmp_path / "c.yaml"),
        "--device",
        "cuda:1",
        "--rank",
        "1",
        "--timeout-s",
        "60",
    ]
    assert jobs[1].log_path == tmp_path / "logs" / "cuda1.log"


# Random tokens and a short target: start-up in seconds (the demo data would be generated first).
FAST = ["data.source=random", "data.num_train=48", "data.num_eval=8", "target.num_layers=4"]


def trainer(tmp_path: Path, *sets: str) -> subprocess.Popen:
    argv = [
        PY,
        "-m",
        "dflash_train",
        "--set",
        f"run.output_dir={tmp_path / 'run'}",
        "--set",
        "run.compile=default",
        "--set",
        "run.parallel_warmup=on",
        "--set",
        f"run.compile_cache_dir={tmp_path / 'cache'}",
    ]
    for item in [*FAST, *sets]:
        argv += ["--set", item]
    # Without TORCHINDUCTOR_CACHE_DIR, which would win over run.compile_cache_dir: the cache is cold.
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(PAYLOAD), PYTHONUNBUFFERED="1")
    return subprocess.Popen(argv, cwd=PAYLOAD, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError("".join(lines))


def output_within(proc: subprocess.Popen, timeout_s: float) -> str:
    """The process's output once it ends; past `timeout_s` it gets SIGTERM (the trainer then stops
    its warm-up process too), 30 s later SIGKILL: what a hung run printed is still there to read."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        return proc.communicate(timeout=30)[0] + f"\n(test: still running after {timeout_s:g} s: SIGTERM)"
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] + f"\n(test: still running after {timeout_s:g} s: SIGTERM, then SIGKILL)"


def test_sigterm_during_the_warm_up_exits_143_at_once(tmp_path):
    proc = trainer(tmp_path, "debug.hang_at=compile")  # the warm-up process hangs where it would compile
    lines = read_until(proc, "parallel warm-up: 1 process(es) compiling on cpu")
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]  # a bound: without the stop poll it would wait 900 s
    assert proc.returncode == 143, "".join(lines) + rest
    assert "stopped by signal 15 before step 1: nothing to save" in rest
    assert "parallel warm-up: 0/1 done" not in rest  # ended inside the warm-up, not after it


def test_a_hung_warm_up_times_out_and_the_run_goes_on(tmp_path):
    # The warm-up of worker 0 hangs past run.warmup_timeout_s: killed, one line, and the run goes on
    # to the threads (which the failed warm-up below shows running; worker 0 would hang at its own
    # compile here, as injected, so SIGTERM ends it: exit 143 at once).
    proc = trainer(tmp_path, "debug.hang_at=compile", "run.warmup_timeout_s=1", "run.threads=2", "data.batch_size=2")
    lines = read_until(proc, "parallel warm-up: 0/1 done")
    text = "".join(lines)
    assert "parallel warm-up: cpu timed out after " in text
    assert "still running after 1 s, killed (run.warmup_timeout_s; log: " in text
    assert "; its worker compiles without the warm cache" in text
    assert lines[-1].rstrip().endswith("the worker threads now compile")
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, "".join(lines) + rest


def test_a_failed_warm_up_is_one_line_and_the_threads_start_regardless(tmp_path):
    # One worker thread: with two, worker 1 could take the compile lock before worker 0 reaches its
    # injected fault, and compile for ~1 min (as it did at random) before the run fails.
    proc = trainer(tmp_path, "debug.fail_at=compile")
    text = proc.communicate(timeout=120)[0]
    # The warm-up's fault, one line with its reason; then worker 0's own (same injected fault).
    assert (
        "parallel warm-up: cpu failed after " in text
        and "exit 1: dflash_train.faults.InjectedFault: injected fault at compile in the warm-up of cpu (log: "
    ) in text, text
    assert "error: worker 0 (cpu) failed during compile/warm-up:" in text
    assert proc.returncode == 1


@pytest.mark.slow
def test_the_threads_compile_from_the_cache_the_warm_up_filled(tmp_path):
    """The cache keys match: after the warm-up process, the threads' compile finds every FX graph
    and AOTAutograd entry in the cache (cold cache dir; about 1 min on 2 CPU cores). Compile scope
    layers, as the 8B preset's multi-GPU runs that the warm-up is for (and ~10% less CPU than the
    tiny target's whole-step graph)."""
    proc = trainer(
        tmp_path,
        "run.compile_scope=layers",
        "run.threads=2",
        "data.batch_size=2",
        "run.steps=2",
        "run.log_every=2",
        "run.eval_every=2",
        "run.checkpoint_every=2",
    )
    text = output_within(proc, 540)  # within pytest's 600 s timeout: a hang still shows the output
    child_log = tmp_path / "run" / "warmup" / "cpu.log"
    child = child_log.read_text() if child_log.exists() else "(no log)"
    everything = f"{text}\n--- warm-up process log {child_log} ---\n{child}"  # every assert's message
    assert proc.returncode == 0, everything
    assert "parallel warm-up: 1/1 done in " in text and "the worker threads now compile from the warm cache" in text, (
        everything
    )
    assert "compiled; AOTAutograd 0 from the cache" in child, everything  # the warm-up compiled: the cache was cold
    line = next((line for line in text.splitlines() if line.startswith("compiled and warmed up: ")), "")
    stats = line.partition("compile cache: ")[2]
    assert (
        "FX graphs 0 from the cache" not in stats
        and " 0 compiled; AOTAutograd" in stats
        and stats.endswith(" 0 compiled")
    ), everything
