"""The run plan (plan.py): each decision made once, on a host with GPUs faked by their count
(`resolve_run` takes the visible GPU count), `--gpus cpu` meaning the CPU everywhere, and the
one pre-flight format of train and regen."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from dflash_train import __main__ as trainer_main
from dflash_train import torch_build
from dflash_train import workers as W
from dflash_train.config import ConfigError, load_config
from dflash_train.plan import resolve_run
from dflash_train.regen_plan import resolve_target
from dflash_train.replica import build_replica, drafter_ops

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload" / "dflash_train"
# The functions that decide how a run executes; plan.resolve_run is their one caller on a run's path.
DECISIONS = {
    "resolve_devices",
    "choose_compile_policy",
    "auto_compile_scope",
    "capture_target_decision",
    "launcher_decision",
    "parallel_warmup_decision",
    "auto_attention",
    "visible_gpus",
}
# The doctor reports what the plan would pick for every setting (its verdict rows), so it asks them too.
REPORTERS = {"plan.py", "doctor_checks.py"}
SMALL = [
    "data.source=random",
    "data.num_train=16",
    "data.num_eval=4",
    "target.num_layers=4",
    "data.batch_size=4",
    "run.steps=4",
]


def plan(*over: str, gpus: int = 0):
    return resolve_run(load_config(overrides=[*SMALL, *over]), cuda_count=gpus)


def test_gpus_cpu_on_a_gpu_host_is_the_cpu_everywhere():
    """The bug of issue 30: `--gpus cpu` (the CLI's `--set run.device=cpu`) trained on every GPU."""
    p = plan("run.device=cpu", gpus=4)
    assert p.devices.workers == ("cpu",) and p.devices.holds == ("cpu",) and p.devices.pin == ()
    assert (p.cfg.run.device, p.cfg.run.gpus, p.cfg.run.dtype) == ("cpu", [], "fp32")
    assert p.policy.effective == "off" and p.launcher == "threads" and p.parallel_warmup == "off"
    assert p.to_json()["holds"] == ["cpu"] and p.to_json()["devices"] == ["cpu"]
    assert p.cfg.drafter.attention == "dense"  # nothing CUDA follows from the host's GPUs


def test_gpus_cpu_preflight_on_a_gpu_host_holds_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(torch_build, "visible_gpus", lambda: 4)
    assert trainer_main.main(["--preflight", "--set", "run.device=cpu", *[a for s in SMALL for a in ("--set", s)]]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (answer["holds"], answer["pin"], answer["devices"]) == (["cpu"], [], ["cpu"])
    assert "gpus" not in answer and answer["plan"]["compile"] == "off"
    # regen's `--gpus cpu` resolves through the same device rule
    assert resolve_target(None, [], "cpu", cuda_count=4)[1].holds == ("cpu",)


def test_auto_takes_every_gpu_and_the_pin_keeps_exactly_them():
    p = plan(gpus=4)
    assert p.devices.workers == ("cuda:0", "cuda:1", "cuda:2", "cuda:3") and p.devices.holds == ("0", "1", "2", "3")
    assert p.devices.pin == ("--set", "run.gpus=[0,1,2,3]")
    pinned = plan(*p.devices.pin[1::2], gpus=4)  # the run started with the pin appended plans the same devices
    assert pinned.devices.workers == p.devices.workers and pinned.devices.pin == ()
    threads = plan("run.threads=2", gpus=4)  # replicas on one GPU: pinned to that GPU, not to a GPU list
    assert threads.devices.workers == ("cuda:0", "cuda:0") and threads.devices.pin == ("--set", "run.device=cuda:0")
    assert plan(gpus=0).devices.holds == ("cpu",) and plan(gpus=0).devices.pin == ()
    explicit = plan("run.gpus=[1,3]", gpus=4)
    assert explicit.devices.holds == ("1", "3") and explicit.devices.pin == ()
    regen = resolve_target(None, [], "auto", cuda_count=2)[1]
    assert regen.holds == ("0", "1") and regen.pin == ("--set", "run.gpus=[0,1]")


def test_each_decision_is_in_the_plan_with_its_reason():
    p = plan("target.hidden_size=4096", "target.num_heads=32", "target.head_dim=128", gpus=4)
    assert (p.policy.effective, p.policy.scope, p.policy.capture_target) == ("default", "layers", True)
    assert (p.launcher, p.parallel_warmup, p.warmup_steps) == ("processes", "off", 1)
    told = " | ".join(p.notes)
    for head in (
        "devices: ",
        "compile: default",
        "compile scope: layers",
        "target forward: one CUDA graph",
        "launcher: processes",
        "parallel warm-up: off",
    ):
        assert head in told, head
    graphs = plan("run.compile=cudagraphs", gpus=1)
    assert (graphs.policy.effective, graphs.policy.scope, graphs.warmup_steps) == ("cudagraphs", "step", 2)
    assert graphs.policy.capture_optimizer and not graphs.policy.capture_target


def test_cudagraphs_with_layers_is_refused_in_one_place():
    with pytest.raises(ConfigError, match="layers cannot use run.compile cudagraphs"):
        load_config(overrides=["run.compile=cudagraphs", "run.compile_scope=layers"])
    sources = [p.read_text() for p in PAYLOAD.glob("*.py")]
    assert sum(s.count("cannot use run.compile cudagraphs") for s in sources) == 1


def test_no_module_but_the_plan_calls_the_decision_functions():
    callers = {}
    for path in PAYLOAD.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in DECISIONS:
                    callers.setdefault(path.name, set()).add(name)
    assert set(callers) <= REPORTERS, callers
    assert callers["plan.py"] == DECISIONS


def test_the_workers_and_replicas_run_the_plans_policy():
    p = plan("run.threads=2")
    replica = build_replica(p.cfg, "cpu", 0, p.policy)
    assert replica.policy is p.policy
    ops = drafter_ops(p.cfg)
    seen = []
    build = ops.build
    ops = W.ReplicaOps(
        lambda device, seed, policy: seen.append(policy) or build(device, seed, policy),
        ops.forward_backward,
        ops.optimizer_step,
        ops.parameters,
    )
    batches = [torch.zeros(0)]  # never read: no step runs (steps=1 with start_step=1)
    options = W.ThreadedOptions(policy=p.policy, warmup_steps=p.warmup_steps, start_step=1, sync_at=W.every(1))
    result = W.run_threaded(ops, list(p.devices.workers), lambda step, rank, world: batches[0], 1, options)
    assert result.policy is p.policy and seen == [p.policy, p.policy]
