"""Start-up on a GPU box, tested on the CPU: device resolution, the compile scope, stops before
step 1, start-up progress, one compiled graph per replica, and the trainer's pre-flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_train import torch_build
from dflash_train import workers as W
from dflash_train.config import ConfigError, load_config
from dflash_train.compiling import private_code
from dflash_train.plan import auto_compile_scope, capture_target_decision, resolve_run

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


@pytest.fixture
def gpus(monkeypatch):
    """This machine as torch would see a box with N GPUs (the resolution logic asks torch_build only)."""

    def see(count: int) -> None:
        monkeypatch.setattr(torch_build, "visible_gpus", lambda: count)

    return see


def resolved(*overrides: str):
    plan = resolve_run(load_config(overrides=list(overrides)))
    return plan.cfg, list(plan.notes)


def worker_devices(*overrides: str) -> list[str]:
    """The plan's worker devices."""
    return list(resolve_run(load_config(overrides=list(overrides))).devices.workers)


def test_auto_device_takes_every_gpu_with_indexed_devices(gpus):
    gpus(4)
    cfg, notes = resolved()
    assert cfg.run.gpus == [0, 1, 2, 3] and cfg.run.threads == 4
    assert worker_devices() == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert any("every visible GPU" in n for n in notes)


@pytest.mark.parametrize("device, expected", [("cuda", ["cuda:0"]), ("cuda:2", ["cuda:2"])])
def test_cuda_devices_always_carry_an_index(gpus, device, expected):
    """`torch.cuda.set_device` refuses a bare `cuda`: the crash of issue 14 item 1."""
    gpus(4)
    assert worker_devices(f"run.device={device}") == expected
    assert all(torch.device(d).index is not None for d in worker_devices(f"run.device={device}"))


def test_auto_with_threads_puts_the_replicas_on_gpu_0(gpus):
    gpus(2)
    assert worker_devices("run.threads=2") == ["cuda:0", "cuda:0"]


@pytest.mark.parametrize(
    "over, message",
    [
        (["run.device=cuda:4"], "torch sees 4 GPU"),
        (["run.gpus=[0,5]"], "torch sees 4 GPU"),
        (["run.device=mps"], "cpu or cuda"),
    ],
)
def test_impossible_devices_are_config_errors(gpus, over, message):
    gpus(4)
    with pytest.raises(ConfigError, match=message):
        resolved(*over)


def test_no_cuda_auto_is_cpu_and_cuda_is_refused(gpus):
    gpus(0)
    assert worker_devices() == ["cpu"]
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolved("run.device=cuda")


def test_compile_scope_auto_follows_the_model_width(gpus):
    gpus(1)
    big, notes = resolved("target.hidden_size=4096", "target.num_heads=32", "target.head_dim=128")
    assert big.run.compile == "default" and big.run.compile_scope == "layers"
    assert any(n.startswith("compile scope: layers") for n in notes)
    assert resolved()[0].run.compile_scope == "step"  # the tiny default: launch-bound, one graph
    assert auto_compile_scope(4096, "cudagraphs")[0] == "step"  # CUDA graphs capture whole steps only
    assert resolved("run.compile_scope=layers", "target.hidden_size=4096")[0].run.compile_scope == "layers"


def test_capture_target_is_on_where_the_target_launches_layer_by_layer(gpus):
    gpus(1)
    wide = ("target.hidden_size=4096", "target.num_heads=32", "target.head_dim=128")

    def told(*over: str) -> tuple[str, str]:
        """(run.capture_target as resolved, the start-up line about it)."""
        cfg, notes = resolved(*over)
        return cfg.run.capture_target, next((n for n in notes if n.startswith("target forward: ")), "")

    setting, line = told(*wide)  # the 8B preset's case: compile default, per-layer scope
    assert setting == "auto"  # kept: an eval or resume elsewhere decides afresh
    assert line.startswith("target forward: one CUDA graph (compile scope layers")
    assert told(*wide, "run.compile_scope=drafter")[1].startswith("target forward: one CUDA graph")
    for why, over in [
        ("compile scope step", ()),
        ("run.compile cudagraphs", ("run.compile=cudagraphs",)),
        ("run.capture_target off", ("run.capture_target=off",)),
    ]:
        assert told(*over)[1].startswith("target forward: layer by layer (" + why), why  # tiny: one step graph
    assert told("run.compile=off")[1] == ""
    with pytest.raises(ConfigError, match="run.capture_target on cannot be used here: compile scope step"):
        resolved("run.capture_target=on")
    gpus(0)
    assert capture_target_decision("auto", False, "default", "layers")[0] == "off"
    # A transformers target is never captured (it failed so on an H200); `on` is refused, not ignored.
    assert capture_target_decision("auto", True, "default", "layers", "transformers")[0] == "off"
    assert capture_target_decision("auto", True, "default", "layers", "native")[0] == "on"
    with pytest.raises(ConfigError, match="a transformers target"):
        capture_target_decision("on", True, "default", "layers", "transformers")
    with pytest.raises(ConfigError, match="CUDA graphs need CUDA"):
        resolved(*wide, "run.capture_target=on")


# --- one compiled graph per replica under CUDA graphs ------------------------------------------


def test_closures_of_one_code_share_a_compiled_graph_unless_given_their_own():
    """Why two replicas on one GPU broke under CUDA graphs, and the fix (`private_code`)."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def make(weight):
        def step(x):
            return (x * weight).sum()

        return step

    x = torch.ones(3)
    first, second = make(torch.ones(3)), make(torch.full((3,), 2.0))
    torch._dynamo.reset()
    torch.compile(first, backend=backend)(x)
    torch.compile(second, backend=backend)(x)
    assert len(graphs) == 1  # the second replica reuses the first one's graph (and would its CUDA graph)
    graphs.clear()
    torch._dynamo.reset()
    mine, theirs = (
        torch.compile(private_code(first), backend=backend),
        torch.compile(private_code(second), backend=backend),
    )
    assert (float(mine(x)), float(theirs(x))) == (3.0, 6.0)
    assert len(graphs) == 2


# --- stops before step 1, start-up progress ------------------------------------------------------


def ops_that_block(release: threading.Event, where: str) -> W.ReplicaOps:
    """A replica whose build or forward/backward blocks until released, as an 8B compile holds
    its worker for minutes."""
    param = torch.nn.Parameter(torch.zeros(2))

    def build(device, seed, policy):
        if where == "build":
            release.wait(60)
        return param

    def forward_backward(replica, batch):
        if where == "forward":
            release.wait(60)
        loss = (replica * 1.0).sum()
        loss.backward()
        return loss

    def optimizer_step(replica, keep_grads):
        replica.grad = replica.grad.zero_() if keep_grads else None

    return W.ReplicaOps(
        build, forward_backward, optimizer_step, lambda replica: [replica], progress=lambda replica: "somewhere"
    )


def run_until_stopped(where: str, stop_when, lines: list[str]) -> W.ThreadedResult:
    """run_threaded with a blocked worker until `stop_when()`; the worker is released and gone after."""
    release = threading.Event()
    options = W.ThreadedOptions(
        warmup_steps=1, stop_before_start=stop_when, on_progress=lines.append, progress_every_s=0.2
    )
    others = threading.enumerate()  # workers other tests of this process left behind: not this run's
    try:
        return W.run_threaded(ops_that_block(release, where), ["cpu"], lambda s, r, w: None, 5, options)
    finally:
        release.set()
        deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
        while W.live_workers(others) and time.monotonic() < deadline:  # it sees the stop and ends
            time.sleep(0.05)
        assert W.live_workers(others) == []


def test_a_stop_before_step_1_returns_at_once_and_says_so():
    lines: list[str] = []
    # Stopped once a progress line came (not after a fixed time: on a busy machine none may have yet).
    result = run_until_stopped("build", lambda: bool(lines), lines)
    assert result.stopped_before_start and result.steps == 0
    assert lines and all(line.startswith("start-up ") for line in lines)
    assert "worker 0 (cpu) build" in lines[0] and "(0/1 workers ready)" in lines[0]


def test_progress_names_the_replica_detail_once_it_is_built():
    lines: list[str] = []
    # Stopped once a line shows the compile phase (the worker blocks there until released).
    result = run_until_stopped("forward", lambda: any("compile/warm-up" in line for line in lines), lines)
    assert result.stopped_before_start
    assert "worker 0 (cpu) compile/warm-up: somewhere" in lines[-1]


def trainer(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(PAYLOAD), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_train", *args],
        env=env,
        cwd=PAYLOAD,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigterm_while_a_worker_is_stuck_before_step_1_exits_143_at_once(tmp_path):
    """Issue 14 item 3: SIGTERM during a compile used to be ignored until the compile ended."""
    proc = trainer("--set", f"run.output_dir={tmp_path / 'run'}", "--set", "debug.hang_at=compile")
    lines = []
    for line in proc.stdout:  # the worker now hangs where a compile would run
        lines.append(line)
        if line.startswith("workers: "):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]  # a bound, not a timing claim: before the fix it never ended
    assert proc.returncode == 143, "".join(lines) + rest
    assert "stopped by signal 15 before step 1: nothing to save" in rest
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_an_earlier_runs_left_behind_worker_does_not_end_a_later_run_in_the_same_process(tmp_path, monkeypatch):
    """main() leaves the process at once (os._exit) only when its own workers are left behind. A
    worker of an earlier run that is still alive in the process (hung on purpose here; in the
    suite, by another test file in the same xdist worker) used to make a later run's main() kill
    the process it was called in."""
    from dflash_train.__main__ import main

    release = threading.Event()
    earlier = threading.Thread(target=release.wait, name="dflash-worker-0", daemon=True)
    earlier.start()
    others = threading.enumerate()  # with workers other tests of this process left behind

    def refuse_exit(code: int) -> None:
        raise AssertionError(f"main() called os._exit({code}) with none of its own workers left behind")

    monkeypatch.setattr(os, "_exit", refuse_exit)
    sets = ["run.device=cpu", "data.source=random", "data.num_train=8", "data.num_eval=4", "run.steps=2"]
    try:
        assert W.live_workers() != []
        code = main(["--set", f"run.output_dir={tmp_path / 'run'}", *[a for s in sets for a in ("--set", s)]])
        assert code == 0
        assert W.live_workers(before=others) == []  # its own workers ended
    finally:
        release.set()
        earlier.join(30)


# --- the pre-flight ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, row, error",
    [
        ("train_path", {"prompt": "hi"}, "line 2 is a prompt row; training reads token or chat rows"),
        (
            "train_path",
            {"messages": [{"role": "user", "content": "hi"}]},
            "line 2 is a messages row, which needs a tokenizer",
        ),
        ("spec_prompts_path", {"prompt": "hi"}, "line 2 is a prompt row, which needs a tokenizer"),
        ("spec_prompts_path", {"input_ids": [1, 2]}, None),
    ],
)
def test_preflight_reads_the_first_row_of_each_data_file(tmp_path, key, row, error):
    """A file whose rows the run cannot read was found only once the run had started (exit 100):
    prompt rows as training data, chat or prompt rows without a tokenizer (the tiny preset has none)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("\n" + json.dumps(row) + "\n")
    source = ["--set", "data.source=jsonl"] if key == "train_path" else []
    proc = trainer("--preflight", "--set", f"run.output_dir={tmp_path / 'run'}", *source, "--set", f"data.{key}={data}")
    out = proc.communicate(timeout=120)[0]
    answer = json.loads(out.strip().splitlines()[-1])
    if error is None:
        assert proc.returncode == 0 and answer["ok"], out
    else:
        assert proc.returncode == 2 and answer["error"] == "config" and error in answer["message"], out
        assert answer["message"].startswith(f"data.{key} {data}: ")


@pytest.mark.parametrize(
    "args, code, error",
    [
        ([], 0, None),
        (["--set", "run.steps=abc"], 2, "run.steps must be int, got 'abc'"),
        (["--set", "run.device=cuda:0"], 2, "CUDA is not available"),
        (["--set", "data.source=jsonl", "--set", "data.train_path=/no/such.jsonl"], 2, "no such file: /no/such.jsonl"),
        (["--set", "data.spec_prompts_path=/no/p.jsonl"], 2, "data.spec_prompts_path: no such file: /no/p.jsonl"),
        (["--preset", "nope"], 2, "unknown preset 'nope'"),
    ],
)
def test_preflight_answers_one_json_line(tmp_path, args, code, error):
    proc = trainer("--preflight", "--set", f"run.output_dir={tmp_path / 'run'}", *args)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == code, out
    answer = json.loads(out.strip().splitlines()[-1])
    if error is None:
        assert answer["ok"] and answer["devices"] == ["cpu"] and (answer["holds"], answer["pin"]) == (["cpu"], [])
        assert "gpus" not in answer and answer["plan"]["launcher"] == "threads"
        assert any(line.startswith("devices: cpu") for line in answer["summary"])
    else:
        assert answer == {"ok": False, "error": "config", "message": answer["message"]} and error in answer["message"]
    assert not (tmp_path / "run").exists()  # nothing built, nothing written
