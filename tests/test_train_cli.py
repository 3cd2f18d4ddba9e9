"""`dflashctl train` as a new user meets it (issue 14): the trainer's pre-flight before anything
starts, a missing module in the container, `--resume RUN`, `--preset`, and a wheel install.

Real parts: the CLI (main(), in-process), the real trainer (tiny, CPU) or the stand-in, sshd + the pct shim.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml
from runs_helpers import ended_run, install_standin, meta, run_dir, wait_until
from sshd import SHIM_VMID
from test_eval import local_env

ROOT = Path(__file__).resolve().parents[1]


def runs_in(workdir: Path) -> list[str]:
    """The run directories on the host (none after a refused start)."""
    root = workdir / "runs"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.fixture
def shim_workdir(shim_host):
    return shim_host, shim_host.container_dir(SHIM_VMID) / "work"


def test_bad_set_value_is_the_trainers_one_line_and_no_run(shim_workdir):
    host, workdir = shim_workdir
    # Checked here by the trainer's config code before the push: the one line, nothing pushed.
    res = host.run_cli("train", "shim", "--set", "run.steps=abc", "--detach", timeout=180)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip().splitlines() == ["error: trainer config: run.steps must be int, got 'abc'"]
    assert not (workdir / "payload").exists()
    # --no-push: the payload in the container decides, in its pre-flight; no run is left either.
    assert host.run_cli("push", "shim").returncode == 0
    res = host.run_cli("train", "shim", "--no-push", "--set", "run.steps=abc", "--detach", timeout=180)
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip().splitlines()[-1] == "error: shim (pct 200): trainer config: run.steps must be int, got 'abc'"
    )
    assert "started run" not in res.stderr and res.stdout == ""
    assert runs_in(workdir) == []


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, " is a directory, not a file"),
        (
            b"run:\n  steps: 5\ndata: {source: [jsonl\n",
            ": line 4, column 1: expected ',' or ']', but got '<stream end>'",
        ),
        (b"run:\n  steps: 5\n  steps: 6\n", ": line 3: duplicate key 'steps' in run (first on line 2)"),
        (b"run:\n  name: \xff\n", ": line 2, column 9: not UTF-8 text (byte 0xff)"),
    ],
)
def test_a_bad_config_file_is_one_line_with_its_path_and_place(shim_workdir, tmp_path, content, problem):
    host, workdir = shim_workdir
    config = tmp_path / "run.yaml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    res = host.run_cli("train", "shim", "--config", str(config), "--detach")
    assert (res.returncode, res.stderr) == (2, f"error: --config: {config}{problem}\n")
    assert not (workdir / "payload").exists()


def test_run_dir_unquoted_in_set_reaches_the_resolved_config(shim_workdir):
    host, workdir = shim_workdir
    res = host.run_cli(
        "train",
        "shim",
        "--set",
        "run.export_dir={run_dir}/export",
        "--set",
        "run.steps=1",
        "--set",
        "run.spec_prompts=0",
        "--follow",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (run_id,) = runs_in(workdir)
    run = workdir / "runs" / run_id
    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    assert resolved["run"]["export_dir"] == f"{run}/export" and (run / "export").is_dir()
    # run.json keeps what the trainer's config code resolved before the push, the token unfilled.
    assert meta(workdir, run_id)["config"]["run"]["export_dir"] == "{run_dir}/export"


def test_gpus_on_a_machine_without_cuda_is_refused_before_a_run_exists(shim_workdir):
    host, workdir = shim_workdir
    res = host.run_cli("train", "shim", "--gpus", "0", "--detach", timeout=180)
    assert res.returncode == 2 and "CUDA is not available" in res.stderr.splitlines()[-1]
    assert runs_in(workdir) == []


def test_a_data_file_without_data_source_jsonl_is_refused_before_the_push(shim_workdir, tmp_path):
    host, workdir = shim_workdir
    # data.source left at demo would train on the demo data and ignore the file: refused, --set or --config.
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  train_path: data:regen.jsonl\n")
    cases = [
        (["--set", "data.train_path=data:regen.jsonl"], "data.train_path is set but data.source is demo"),
        (["--config", str(config)], "data.train_path is set but data.source is demo"),
        (
            ["--set", "data.source=random", "--set", "data.eval_path=x.jsonl"],
            "data.eval_path is set but data.source is random",
        ),
    ]
    for args, why in cases:
        res = host.run_cli("train", "shim", *args, "--set", "run.steps=5", "--follow", timeout=180)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.splitlines() == [f"error: trainer config: {why}: add --set data.source=jsonl"]
    assert not (workdir / "payload").exists() and runs_in(workdir) == []


def bare_python(tmp_path: Path) -> Path:
    """An interpreter with the standard library only: a container where torch was never installed."""
    env_dir = tmp_path / "bare-venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    return env_dir / "bin" / "python"


def test_no_torch_in_the_container_is_one_line_exit_4(tmp_path, shim_host):
    python = bare_python(tmp_path)
    workdir = tmp_path / "work"
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        f"default: box\nhosts:\n  box:\n    transport: local\n    python: {json.dumps(str(python))}\n"
        f"    workdir: {json.dumps(str(workdir))}\n"
    )
    res = shim_host.run_cli("train", "box", "--follow", env={"DFLASHCTL_INVENTORY": str(inventory)}, timeout=180)
    assert res.returncode == 4, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: box: ") and "is not installed in" in last and "python:" in last
    assert "Traceback" not in res.stderr + res.stdout and runs_in(workdir) == []


def test_run_tensorboard_without_the_package_is_one_line_exit_4_at_preflight(tmp_path, shim_host):
    """Issue 28: `run.tensorboard: true` where tensorboard is not installed (a module on the
    trainer's PYTHONPATH that fails to import as the missing package does) stops at the pre-flight."""
    absent = tmp_path / "absent"
    absent.mkdir()
    (absent / "tensorboard.py").write_text(
        'raise ModuleNotFoundError("No module named \'tensorboard\'", name="tensorboard")\n'
    )
    env = local_env(tmp_path)
    res = shim_host.run_cli(
        "train",
        "local",
        "--set",
        "run.tensorboard=true",
        "--env",
        f"PYTHONPATH={absent}",
        "--follow",
        env=env,
        timeout=180,
    )
    assert res.returncode == 4, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: local: tensorboard is not installed in ")
    assert "(run.tensorboard needs it); install it there" in res.stderr and "Traceback" not in res.stderr
    assert runs_in(tmp_path / "wd") == []


def test_resume_continues_a_stopped_run_in_its_directory(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    started = shim_host.run_cli(
        "train",
        "shim",
        "--no-push",
        "--name",
        "r",
        "--set",
        "run.steps=8",
        "--set",
        "standin.step_time=0.05",
        "--set",
        "standin.hold_at=5",
        "--detach",
    )
    run_id = started.stdout.strip()
    # Held after step 5 until the stop: a slow `runs stop` cannot find the run already ended.
    wait_until(lambda: "holding after step 5" in (run_dir(workdir, run_id) / "train.log").read_text(), 60, "step 5")
    stopped = shim_host.run_cli("runs", "stop", "shim", run_id)
    assert stopped.returncode == 0 and "stopped (143)" in stopped.stdout
    log = (run_dir(workdir, run_id) / "train.log").read_text()
    assert f"dflashctl train shim --resume {run_id}" in log
    refused = shim_host.run_cli("train", "shim", "--resume", run_id, "--set", "run.steps=5")
    assert refused.returncode == 2 and "drop --set" in refused.stderr
    resumed = shim_host.run_cli("train", "shim", "--no-push", "--resume", "r", "--follow", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed run {run_id} on shim (pct 200), CPU" in resumed.stderr
    assert "standin: resuming after step" in resumed.stdout and "standin: done" in resumed.stdout
    info = meta(workdir, run_id)
    assert info["resumes"] == 1 and info["argv"][-1] == "--resume"
    listed = json.loads(shim_host.run_cli("runs", "list", "shim", "--json").stdout)
    assert [(r["run_id"], r["state"]) for r in listed] == [(run_id, "succeeded")]
    busy = shim_host.run_cli("train", "shim", "--no-push", "--set", "run.steps=100000", "--detach").stdout.strip()
    again = shim_host.run_cli("train", "shim", "--no-push", "--resume", busy)
    assert again.returncode == 6 and "still running" in again.stderr
    shim_host.run_cli("runs", "stop", "shim", busy)


def test_preset_reaches_the_trainer(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    res = shim_host.run_cli("train", "shim", "--no-push", "--preset", "qwen3-8b", "--set", "run.steps=1", "--follow")
    assert res.returncode == 0, res.stderr
    (run_id,) = runs_in(workdir)
    argv = meta(workdir, run_id)["argv"]
    assert argv[argv.index("--preset") + 1] == "qwen3-8b"
    (cache,) = [a for a in argv if a.startswith("run.compile_cache_dir=")]
    assert cache == f"run.compile_cache_dir={workdir}/cache/compile"  # {workdir} expanded in the container


def test_a_wheel_install_pushes_and_trains(tmp_path, shim_host):
    """Issue 14 item 8: `pip install dflashctl` (not -e) must find the trainer it pushes."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "dflashctl", "remote_payload"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    site = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            *map(str, wheels.glob("dflashctl-*.whl")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    workdir = tmp_path / "work"
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        f"default: local\nhosts:\n  local:\n    transport: local\n    workdir: {json.dumps(str(workdir))}\n"
    )
    env = dict(os.environ, DFLASHCTL_INVENTORY=str(inventory), PYTHONPATH=str(site))
    cli = [
        sys.executable,
        "-c",
        "import dflashctl, sys; assert dflashctl.__file__.startswith(sys.argv[1]); "
        "from dflashctl.cli import main; sys.argv[1:2] = []; main()",
        str(site),
    ]
    res = subprocess.run(
        [*cli, "train", "local", "--set", "run.steps=2", "--set", "run.eval_every=2", "--follow"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    shipped = site / "dflashctl" / "_payload" / "dflash_train" / "train.py"
    pushed = workdir / "payload" / "dflash_train" / "train.py"
    assert (
        pushed.read_bytes()
        == shipped.read_bytes()
        == (ROOT / "remote_payload" / "dflash_train" / "train.py").read_bytes()
    )
    assert "exported drafter" in res.stdout
    assert (
        site / "dflashctl" / "_payload" / "dflash_train" / "hf" / "dflash.py"
    ).is_file()  # the export's modeling file
    exports = list((workdir / "runs").glob("*/export"))
    assert exports and (exports[0] / "dflash.py").is_file() and (exports[0] / "dflash_model.py").is_file()


def test_a_resume_as_the_other_kind_is_refused_before_anything_is_pushed(sshd_host, tmp_path):
    """`train --resume` of a data run pushed the payload, then runctl refused it; the run's record
    (which `train --resume` reads anyway, for its group) refuses it first. So does `data regen
    --resume` of a training run, which now reads the record before the push instead of after."""
    workdir, env = tmp_path / "wd", local_env(tmp_path)
    ended_run(workdir, "20261201-100000-da7a", 1, kind="data", name="out.jsonl")
    ended_run(workdir, "20261201-110000-7a1b", 1)
    for command, run_id, how in (
        (["train", "local"], "20261201-100000-da7a", "a data run: continue it with dflashctl data regen"),
        (["data", "regen", "local"], "20261201-110000-7a1b", "a train run: continue it with dflashctl train"),
    ):
        res = sshd_host.run_cli(*command, "--resume", run_id, "--detach", env=env)
        assert (res.returncode, res.stdout) == (2, ""), res.stderr
        assert res.stderr == f"error: local: run {run_id} is {how} local --resume {run_id}\n"
    assert not (workdir / "payload").exists()


def test_a_resume_of_a_training_run_that_succeeded_is_refused_and_leaves_its_record(sshd_host, tmp_path):
    """The trainer, at run.steps, had nothing to train, but the resume moved the run's start and
    counted a resume: refused like a data run's, before anything is pushed."""
    workdir, env = tmp_path / "wd", local_env(tmp_path)
    record = ended_run(workdir, "20261201-120000-d0e5", 0) / "run.json"
    before = record.read_bytes()
    res = sshd_host.run_cli("train", "local", "--resume", "20261201-120000-d0e5", "--detach", env=env)
    assert (res.returncode, res.stdout) == (6, ""), res.stderr
    assert res.stderr == "error: local: run 20261201-120000-d0e5 already succeeded: nothing to resume\n"
    assert record.read_bytes() == before and not (workdir / "payload").exists()


def test_no_push_on_a_host_without_a_trainer_says_to_push(shim_workdir):
    host, workdir = shim_workdir
    res = host.run_cli("train", "shim", "--no-push", "--detach")
    assert res.returncode == 1 and "push it first (dflashctl push)" in res.stderr.strip().splitlines()[-1]
    assert runs_in(workdir) == []


@pytest.mark.parametrize("command", [["train", "local"], ["data", "regen", "local", "--prompts", "p", "--out", "o"]])
def test_follow_and_detach_together_are_refused(shim_host, command):
    """Both were accepted, the last one winning; the usage line shows them as alternatives."""
    res = shim_host.run_cli(*command, "--follow", "--detach")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == "error: --follow and --detach contradict each other: give one\n"


def test_queue_and_force_together_are_refused(shim_host):
    """`--queue --force` was accepted and started at once, past the runs queued before it."""
    res = shim_host.run_cli("train", "local", "--queue", "--force")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == "error: --queue waits for the GPUs and --force takes them at once: give one\n"


def test_a_rendezvous_port_for_one_host_is_refused(shim_host):
    """`train local --rdzv-port P` started the run and ignored P (one host has no rendezvous);
    refused before anything is pushed or started, as `--resume` of a one-host run refuses it."""
    res = shim_host.run_cli("train", "local", "--rdzv-port", "29501")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == "error: --rdzv-port is for a run across several hosts; one on local has none: drop it\n"
    assert shim_host.run_cli("runs", "list", "local").stdout.count("\n") <= 1  # no run started


@pytest.mark.parametrize("flag", [["--queue"], ["--on-event", "true"]], ids=lambda f: f[0])
def test_resume_refuses_what_only_a_new_start_takes(shim_host, flag):
    """--queue and --on-event were dropped unsaid with --resume (the run keeps its hook; a resume
    never waited for GPUs): refused, before any host is asked. (--rdzv-port moves a run across
    hosts' rendezvous: tests/test_multihost.py.)"""
    res = shim_host.run_cli("train", "local", "--resume", "r", *flag)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == f"error: --resume continues a run as it was started (config, GPUs, hook): drop {flag[0]}\n"
