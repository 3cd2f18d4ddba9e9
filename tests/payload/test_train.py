"""End-to-end training on the tiny config through the threaded workers: learning, frozen target,
resume, SIGTERM, export, and `python -m dflash_train` in several threads with injected faults."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from dflash_train.checkpoint import StopFlag, latest_checkpoint
from dflash_train.config import TargetConfig, load_config
from dflash_train.data import BlockSampler, build_datasets
from dflash_train.export import load_exported, spec_from_config
from dflash_train.model import DFlashDrafter, block_mask
from dflash_train.target import build_tiny_target
from dflash_train.compiling import EAGER  # what the plan picks on the CPU: run.compile off
from dflash_train.replica import build_replica, train_step
from dflash_train.train import run_training
from dflash_train.workers import WorkerError

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"
STEPS = 120


def read_metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# Two worker threads with 4 sequences each: the same global batches (8) as the one-thread default.
THREADED = ["run.threads=2", "data.batch_size=4"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One 120-step tiny run in two worker threads (checkpoints at 60 and 120), shared below."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    cfg = load_config(
        overrides=[
            f"run.output_dir={out}",
            f"run.steps={STEPS}",
            "run.log_every=1",
            "run.eval_every=60",
            "run.checkpoint_every=60",
            "run.keep_checkpoints=3",
            *THREADED,
        ]
    )
    logs = []
    assert run_training(cfg, log=logs.append) == 0
    return out, logs


def test_held_out_acceptance_length_rises(tiny_run):
    # Measured (CPU, torch 2.13): after the default 300 steps 3.426 (teacher-forced); 120 steps here, 2 replicas.
    out, logs = tiny_run
    evals = [r for r in read_metrics(out) if r["event"] in ("eval", "final")]
    untrained, final = evals[0]["acceptance_length"], evals[-1]["acceptance_length"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    assert untrained < 1.1
    assert final > 2.5
    assert logs[-1].startswith("final held-out teacher-forced acceptance length")
    assert any(line.startswith("workers: 2 replica(s) in sync at step 120") for line in logs)


def test_evaluations_report_the_real_speculative_tau_beside_the_proxy(tiny_run):
    """Issue 15: at each evaluation after step 0, a greedy draft-and-verify decode of held-out prompts."""
    out, logs = tiny_run
    evals = [r for r in read_metrics(out) if r["event"] in ("eval", "final")]
    assert "spec_tau" not in evals[0]  # step 0: not decoded
    for record in evals[1:]:
        assert 1.0 <= record["spec_tau"] <= 8 and record["spec_prompts"] == 4 and record["spec_steps"] > 0
        assert 1.0 <= record["spec_tau_prompt_mean"] <= 8  # issue 26: the per-prompt mean beside the pooled
        assert record["spec_tau_prompt_se"] > 0 and record["spec_eval_s"] > 0  # its spread over 4 prompts, its cost
        assert len(record["spec_by_position"]) == 7 and record["spec_by_position"] == sorted(
            record["spec_by_position"], reverse=True
        )
    assert any("teacher-forced acceptance length" in line and "speculative tau" in line for line in logs)
    assert "speculative tau" in logs[-1] and "teacher-forced" in logs[-1]


def test_metrics_records(tiny_run):
    out, _ = tiny_run
    train = [r for r in read_metrics(out) if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    keys = {
        "step",
        "total_steps",
        "loss",
        "acceptance_length",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "gpu_mem_gb",
    }
    assert keys <= set(train[0])
    assert train[0]["gpu_mem_gb"] is None
    assert train[59]["acceptance_length"] is not None and train[58]["acceptance_length"] is None
    assert (Path(out) / "config.resolved.yaml").exists()


def copy_to_step_60(out: Path, resumed: Path) -> None:
    """A run directory as the tiny run left it at its step-60 checkpoint."""
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000060", resumed / "checkpoints" / "step_00000060")
    shutil.copy(out / "metrics.jsonl", resumed / "metrics.jsonl")


def resume_config(resumed: Path, *sets: str):
    return load_config(
        overrides=[
            f"run.output_dir={resumed}",
            f"run.steps={STEPS}",
            "run.log_every=1",
            "run.eval_every=60",
            "run.checkpoint_every=60",
            *THREADED,
            *sets,
        ]
    )


def test_resume_reproduces_the_uninterrupted_loss(tiny_run, tmp_path):
    """From the step-60 checkpoint, written in the background while the tiny run trained on, and
    then from the step-61 one that a stop wrote (issue 31: both copied to host memory, then written)."""
    out, _ = tiny_run
    resumed = tmp_path / "resumed"
    copy_to_step_60(Path(out), resumed)
    uninterrupted = {r["step"]: r for r in read_metrics(out) if r["event"] == "train"}
    for step in (61, 62):
        # A stop requested at the start of `step` (debug.stop_at: as a SIGTERM at that moment).
        stop, logs = StopFlag(), []
        cfg = resume_config(resumed, f"debug.stop_at=step:{step}")
        assert run_training(cfg, resume=True, stop=stop, log=logs.append) == 143
        assert stop.signum == signal.SIGTERM
        got = [r for r in read_metrics(resumed) if r["event"] == "train"]
        assert got[-1]["step"] == step and len(got) == step  # records after the checkpoint were dropped
        assert got[-1]["loss"] == uninterrupted[step]["loss"]
        assert got[-1]["grad_norm"] == uninterrupted[step]["grad_norm"]
        assert latest_checkpoint(resumed).name == f"step_{step:08d}"
        # The stop waited for its checkpoint's write before the run's last line; the flush to the
        # disk and the removal of the checkpoints it replaces are left to a process of its own (no
        # fsync in the stop's wait), which succeeds; then the newest `keep_checkpoints` are left.
        written = f"checkpoint: {latest_checkpoint(resumed)} (written in "
        assert logs[-2].startswith(written), logs[-3:]
        flusher = re.search(r"flushed to disk after the exit by pid (\d+), which then removes older", logs[-2])
        assert flusher, logs[-2]
        assert os.waitpid(int(flusher.group(1)), 0)[1] == 0
        kept = sorted(p.name for p in (resumed / "checkpoints").glob("step_*"))
        assert len(kept) == 2 and kept[-1] == f"step_{step:08d}"
        assert logs[-1].startswith(f"stopped by signal 15 after step {step}")
        assert re.search(r"--resume \(stopped \d+\.\d s after the signal\)$", logs[-1]), logs[-1]


def test_checkpoints_log_the_time_training_was_blocked_and_the_write(tiny_run):
    """Issue 31: each checkpoint's line says how long the step loop waited (the copy to host memory,
    into buffers allocated ahead), and a second line its background write; the last one is written
    before the final line."""
    out, logs = tiny_run
    blocked = [line for line in logs if line.startswith("checkpoint step ")]
    assert [line.split(":")[0] for line in blocked] == ["checkpoint step 60", "checkpoint step 120"]
    # The buffers were allocated ahead, after the first step: no checkpoint allocates.
    assert not any("new host buffers" in line for line in blocked)
    assert all(" training blocked " in line and " GB to host memory in " in line for line in blocked)
    root = out / "checkpoints"
    written = [line for line in logs if line.startswith("checkpoint: ")]
    assert [line.split(" ")[1] for line in written] == [str(root / "step_00000060"), str(root / "step_00000120")]
    assert all(line.endswith(" in the background, on disk)") for line in written)  # fsynced: periodic, final
    assert logs.index(written[1]) < len(logs) - 1 and logs[-1].startswith("final held-out")


def test_a_failed_checkpoint_write_fails_the_run(tmp_path):
    """A background write that fails (debug.fail_checkpoint: after its weights and optimizer files)
    fails the run at the next sync point, with the write's error; nothing of it is taken by --resume."""
    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"run.output_dir={out}",
            *SMALL,
            "run.steps=4",
            "run.log_every=2",
            "run.eval_every=2",
            "run.checkpoint_every=2",
            "debug.fail_checkpoint=2",
        ]
    )
    with pytest.raises(WorkerError) as failed:
        run_training(cfg, log=lambda _: None)
    message = str(failed.value)
    assert "worker 0 (cpu) failed during step 4 on_sync" in message
    assert "CheckpointWriteError: writing the checkpoint of step 2 failed after " in message
    assert "InjectedFault: injected fault writing checkpoint step 2 (debug.fail_checkpoint)" in message
    assert latest_checkpoint(out) is None
    assert not (out / "checkpoints" / ".tmp_step_00000002" / "meta.json").exists()


def test_a_stop_requested_before_the_first_step_trains_nothing(tiny_run, tmp_path):
    """The stop rule (issue 29): a stop that came before step 1 starts always ends the run there,
    however fast the workers reach it; nothing is trained or saved."""
    out, _ = tiny_run
    resumed = tmp_path / "resumed"
    copy_to_step_60(Path(out), resumed)
    stop = StopFlag()
    stop.request(signal.SIGTERM)
    logs = []
    assert run_training(resume_config(resumed), resume=True, stop=stop, log=logs.append) == 143
    assert logs[-1] == "stopped by signal 15 before step 61: nothing to save"
    assert latest_checkpoint(resumed).name == "step_00000060"
    assert max(r["step"] for r in read_metrics(resumed)) == 60  # no step trained or logged


def test_export_round_trip(tiny_run):
    out, _ = tiny_run
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"target_layer_ids": [1, 2, 3], "mask_token_id": 511}
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (1, 64, 16)
    exported, _ = load_exported(export)
    trained = DFlashDrafter(spec_from_config(config))
    trained.load_state_dict(load_file(str(latest_checkpoint(out) / "drafter.safetensors")))
    assert set(load_file(str(export / "model.safetensors"))) == set(trained.state_dict())
    head = build_tiny_target(TargetConfig(), seed=0).lm_head.weight
    anchors = torch.tensor([[8, 20, 40]])
    feats, embeds = torch.randn(1, 64, 3 * 64), torch.randn(1, 24, 64)
    mask = block_mask(anchors, 64, 8, "dense")
    with torch.no_grad():
        logits = [d(feats, embeds, anchors, mask) @ head.T for d in (exported, trained)]
    assert torch.equal(logits[0], logits[1])


def test_target_and_embeddings_stay_frozen(tiny_cfg):
    replica = build_replica(tiny_cfg, "cpu", 0, EAGER)
    train, _ = build_datasets(tiny_cfg, tiny_cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, tiny_cfg.data, tiny_cfg.drafter.block_size, 0)
    target_before = {k: v.clone() for k, v in replica.target.state_dict().items()}
    drafter_before = {k: v.clone() for k, v in replica.drafter.state_dict().items()}
    for step in range(3):
        train_step(replica, sampler.batch(step))
    assert all(torch.equal(v, target_before[k]) for k, v in replica.target.state_dict().items())
    assert all(p.grad is None for p in replica.target.parameters())
    changed = [k for k, v in replica.drafter.state_dict().items() if not torch.equal(v, drafter_before[k])]
    assert set(changed) == set(drafter_before)  # every drafter tensor trains (fc and norms too)


def trainer(out, *sets, **popen):
    """`python -m dflash_train` on the tiny config with --set overrides."""
    argv = [sys.executable, "-m", "dflash_train", "--set", f"run.output_dir={out}"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.Popen(argv, cwd=PAYLOAD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_sigterm_saves_and_exits_143(tmp_path):
    out = tmp_path / "run"
    proc = trainer(out, "run.steps=100000", "run.log_every=1", *THREADED)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, rest
    assert "stopped by signal 15" in rest
    step = int(latest_checkpoint(out).name.split("_")[1])
    assert step >= 3
    assert read_metrics(out)[-1]["step"] == step


# Small and fast: random tokens, few sequences (the CLI tests below pay mostly for importing torch).
SMALL = ["data.source=random", "data.num_train=48", "data.num_eval=8", "target.num_layers=4"]


def test_cli_three_threads_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = trainer(
        out,
        *SMALL,
        "run.threads=3",
        "data.batch_size=2",
        "run.steps=12",
        "run.log_every=4",
        "run.eval_every=6",
        "run.checkpoint_every=6",
    )
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, text
    assert "workers: 3 thread(s) on cpu, cpu, cpu, 48 training sequences" in text and "batch 2 per worker" in text
    assert "devices: 3 x cpu" in text and "resolved config:" not in text  # a summary, not 80 lines of YAML
    assert (out / "config.resolved.yaml").is_file() and f"full config: {out / 'config.resolved.yaml'}" in text
    assert "workers: 3 replica(s) in sync at step 12" in text
    assert "final held-out teacher-forced acceptance length" in text
    records = read_metrics(out)
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [4, 6, 8, 12]  # log_every, plus the eval step
    assert [r["step"] for r in records if r["event"] in ("eval", "final")] == [0, 6, 12]
    # tokens_per_s counts every replica's sequences: 3 x 2 sequences of 64 tokens per step.
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in train)
    assert train[0]["tokens_per_s"] == pytest.approx(4 * 6 * 64 / (4 * train[0]["step_time_s"]), rel=1e-6)
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_00000006", "step_00000012"]


@pytest.mark.parametrize(
    "fault,phase",
    [
        ("fail_at=build", "build"),
        ("fail_at=compile", "compile/warm-up"),
        ("fail_at=step:1", "step 1 forward/backward"),
        ("fail_at=step:5", "step 5 forward/backward"),
        ("hang_at=step:1", "step 1 gradient all-reduce"),
    ],
)
def test_cli_fault_exits_nonzero_with_the_traceback(tmp_path, fault, phase):
    # A tight step barrier only where a hang must trip it, and the hang in step 1, so that no step
    # has to pass a tight barrier first (a step takes 0.5-1.5 s on a busy 2-core machine; two
    # threads' steps can differ by seconds). Start-up waits keep run.compile_timeout_s's default.
    # A hang would show as communicate's timeout.
    tight = ["run.barrier_timeout_s=4"] if fault.startswith("hang_at") else []
    proc = trainer(
        tmp_path / "run",
        *SMALL,
        "run.threads=2",
        "data.batch_size=2",
        "run.steps=8",
        f"debug.{fault}",
        "debug.fail_rank=1",
        *tight,
    )
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, text
    if fault.startswith("fail_at"):
        assert f"error: worker 1 (cpu) failed during {phase}:" in text
        assert "Traceback (most recent call last)" in text and "InjectedFault: injected fault at" in text
    else:  # the hung worker is 1; worker 0 times out at the barrier and names every worker's phase
        assert f"error: worker 0 (cpu) failed during {phase}:" in text
        assert "barrier timed out after 4s\nphases: ['step 1 gradient all-reduce', 'step 1 forward/backward']" in text


def test_bad_debug_fault_spec_is_a_config_error():
    from dflash_train.config import ConfigError

    with pytest.raises(ConfigError, match="debug.fail_at must be build, compile or step:K"):
        load_config(overrides=["debug.fail_at=step:0"])
