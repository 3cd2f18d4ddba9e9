"""Run lifecycle end to end: `train`, `runs list/show/stop`, through real sshd + the pct shim.

The trainer is tests/standin_trainer.py installed as `dflash_train` in the container's payload
(same command line as the real trainer). Nothing asserts on timing: waits are bounded polls.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from runs_helpers import install_standin, local_session, meta, race, readers, run_dir, wait_until
from sshd import CLI, SHIM_VMID

from dflashctl.devices import CPU, GpuChoice, parse_gpus
from dflashctl.errors import ConflictError, NotFoundError, UsageError
from dflashctl.inventory import HostSpec
from dflashctl.runs import (
    BYTECODE_CACHE,
    COMPILE_CACHE,
    RUN_DIR_TOKEN,
    list_runs,
    resume_run,
    check_trainer_config,
    show_run,
    start_run,
    stop_run,
    trainer_argv,
)

REPO = Path(__file__).resolve().parents[1]
LONG = ["run.steps=100000", "standin.step_time=0.05"]


def kill_leftovers(workdir: Path) -> None:
    """Whatever a failed test left running must not outlive it."""
    for path in (workdir / "runs").glob("*/run.json"):
        info = json.loads(path.read_text())
        for key in ("trainer", "supervisor"):
            pid = (info.get(key) or {}).get("pid")
            if pid and not (path.parent / "exit_code").exists():
                try:
                    os.killpg(pid, signal.SIGKILL) if key == "trainer" else os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def shim(shim_host):
    """(sshd host, in-process session, container workdir) with the stand-in trainer installed."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    session = shim_host.session()
    yield shim_host, session, workdir
    session.close()
    kill_leftovers(workdir)


def state(session, run_id: str) -> str:
    return show_run(session.target("shim"), run_id)["state"]


# --- unit: command line, GPUs, config ----------------------------------------------------------


def test_trainer_argv_places_gpus_and_output_dir_before_user_overrides():
    host = HostSpec(name="h", python="/venv/bin/python")
    argv = trainer_argv(host, "/w/runs/r1", "/w/runs/r1/c.yaml", ["run.steps=3"], GpuChoice((0, 2)), preset="qwen3-8b")
    assert argv == [
        "/venv/bin/python",
        "-m",
        "dflash_train",
        "--preset",
        "qwen3-8b",
        "--config",
        "/w/runs/r1/c.yaml",
        "--set",
        "run.output_dir=/w/runs/r1",
        "--set",
        f"run.compile_cache_dir={COMPILE_CACHE}",
        "--set",
        f"run.bytecode_cache_dir={BYTECODE_CACHE}",
        "--set",
        "data.dir={workdir}/data",
        "--set",
        "run.gpus=[0,2]",
        "--set",
        "run.steps=3",
    ]
    assert "run.device=cuda:1" in trainer_argv(host, RUN_DIR_TOKEN, None, [], GpuChoice((1,)))
    # No choice: the trainer's own resolution decides; `--gpus cpu` says so (it trained on every GPU).
    assert not any("device" in a or "gpus" in a for a in trainer_argv(host, RUN_DIR_TOKEN, None, [], GpuChoice()))
    assert "run.device=cpu" in trainer_argv(host, RUN_DIR_TOKEN, None, [], parse_gpus("cpu", (0, 1)))


def test_parse_gpus(tmp_path):
    assert parse_gpus(None, (0, 1)) == GpuChoice((0, 1)) and parse_gpus(None, (0, 1)).text() == "0,1"
    assert parse_gpus(None).auto and parse_gpus(None).names() == [CPU] and parse_gpus(None).text() == "auto"
    assert parse_gpus("3, 1", (0, 1)).names() == ["3", "1"]
    assert parse_gpus(" CPU", (0, 1)) == GpuChoice(cpu=True) and parse_gpus("cpu").text() == CPU
    for bad in ("0,0", "a", "1,", "0,00"):
        with pytest.raises(UsageError):
            parse_gpus(bad, (0, 1))


def test_the_trainers_own_config_code_checks_the_options(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {steps: 5}\n")
    checked = check_trainer_config(
        None, cfg, "tiny", ["optim.lr=0.001", "run.export_dir={run_dir}/export"], GpuChoice((1,))
    )
    assert checked is not None and checked["run"]["steps"] == 5 and checked["optim"]["lr"] == 1e-3
    assert (checked["run"]["export_dir"], checked["run"]["output_dir"]) == ("{run_dir}/export", RUN_DIR_TOKEN)
    assert checked["run"]["device"] == "cuda:1"  # dflashctl's own --set items are checked with the user's
    for bad, message in (
        ("novalue", "not of the form key=value"),
        ("run.steps=[", "run.steps: the value '['"),
        ("run.stpes=3", "unknown config key 'run.stpes'"),
    ):
        with pytest.raises(UsageError, match=rf"^trainer config: .*{re.escape(message)}"):
            check_trainer_config(None, None, None, [bad], GpuChoice())
    with pytest.raises(UsageError, match="^trainer config: unknown preset 'huge'"):
        check_trainer_config(None, None, "huge", [], GpuChoice())
    # A payload without the trainer's config code (another trainer): its pre-flight decides.
    assert check_trainer_config(install_standin(tmp_path / "standin"), None, None, ["standin.x=1"], GpuChoice()) is None


def test_a_typo_in_set_fails_before_the_push_and_the_host_keeps_its_payload(shim_host, tmp_path):
    source = tmp_path / "payload_src"
    shutil.copytree(REPO / "remote_payload", source, ignore=shutil.ignore_patterns("__pycache__"))
    assert shim_host.run_cli("push", "shim", "--source", str(source)).returncode == 0
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    live, versions = os.readlink(workdir / "payload"), sorted(os.listdir(workdir / ".payload" / "v"))
    (source / "changed.txt").write_text("a change the next push would carry\n")
    res = shim_host.run_cli("train", "shim", "--source", str(source), "--detach", "--set", "run.stpes=3")
    assert res.returncode == 2 and res.stdout == "", res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: trainer config: unknown config key 'run.stpes' (keys in run: steps, ")
    assert os.readlink(workdir / "payload") == live and sorted(os.listdir(workdir / ".payload" / "v")) == versions
    assert not (workdir / "runs").exists() or not any((workdir / "runs").iterdir())


# --- end to end through sshd + pct shim ----------------------------------------------------------


def test_train_follow_pushes_runs_and_stores_hostile_name_literally(shim, tmp_path):
    host, _, workdir = shim
    source = install_standin(tmp_path / "payload_src")
    marker = tmp_path / "pwned"
    name = f"$(touch {marker}); `touch {marker}` [bold]x[/] 'q\" ü"
    config = tmp_path / "run.yaml"
    config.write_text("standin.lines: 2\n")
    res = host.run_cli(
        "train",
        "shim",
        "--source",
        str(source),
        "--follow",
        "--name",
        name,
        "--config",
        str(config),
        "--set",
        "run.steps=5",
        binary=True,
    )
    assert res.returncode == 0, res.stderr
    (run_id,) = [p.name for p in (workdir / "runs").iterdir() if p.is_dir()]
    log = (run_dir(workdir, run_id) / "train.log").read_bytes()
    assert res.stdout == log and b"standin: done" in log and b"step 5/5 loss 3.3333 line 1" in log
    assert (run_dir(workdir, run_id) / "config.input.yaml").read_text() == config.read_text()
    assert f"run {run_id} succeeded".encode() in res.stderr
    info = meta(workdir, run_id)
    assert info["name"] == name and info["payload_hash"] and info["gpus"] == [CPU]
    assert info["config"] is None  # the stand-in payload has no config code to check it before the push
    table = host.run_cli("runs", "list", "shim")
    assert "$(touch" in table.stdout and "[bold]x[/]" in table.stdout
    assert not marker.exists()


def test_gpus_cpu_on_a_host_with_gpus_holds_the_cpu_and_tells_the_trainer(shim):
    # The stand-in's pre-flight pretends to see 2 GPUs; left to itself it takes both and pins them.
    host, _, workdir = shim
    ids = {}
    for flag in ([], ["--gpus", "cpu"]):
        res = host.run_cli(
            "train",
            "shim",
            "--no-push",
            "--detach",
            "--force",
            *flag,
            "--set",
            "run.steps=1",
            "--set",
            "standin.visible_gpus=2",
        )
        assert res.returncode == 0, res.stderr
        ids[bool(flag)] = res.stdout.strip()
    auto, cpu = meta(workdir, ids[False]), meta(workdir, ids[True])
    assert auto["gpus"] == ["0", "1"] and auto["argv"][-2:] == ["--set", "run.gpus=[0,1]"]
    assert cpu["gpus"] == [CPU] and "run.device=cpu" in cpu["argv"] and "run.gpus=[0,1]" not in cpu["argv"]
    listed = {r["run_id"]: r["gpus"] for r in json.loads(host.run_cli("runs", "list", "shim", "--json").stdout)}
    assert listed[ids[True]] == [CPU]


def test_a_trainer_from_before_the_run_plan_is_refused_with_the_way_out(shim):
    # --no-push kept an older trainer in the container: its pre-flight has no `holds` to lock and pin.
    host, _, workdir = shim
    res = host.run_cli("train", "shim", "--no-push", "--detach", "--set", "standin.preflight_v1=true")
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("\n") == 1 and "predates this dflashctl's run plan: push it" in res.stderr
    assert not [p for p in (workdir / "runs").iterdir() if p.name != ".lock"]


def test_failed_run_exit_codes_and_tail(shim):
    host, _, workdir = shim
    res = host.run_cli("train", "--no-push", "--follow", "--set", "run.steps=5", "--set", "standin.fail_at=2")
    assert res.returncode == 100, res.stderr
    assert "failed (exit code 3)" in res.stderr and "failing at step 2" in res.stdout
    run_id = res.stderr.split("started run ")[1].split()[0]
    again = host.run_cli("logs", "tail", "shim", run_id[:-2], "-f")
    assert again.returncode == 100 and again.stdout == res.stdout
    tail = host.run_cli("logs", "tail", run_id, "-n", "1")  # one argument that is not a host: a run
    assert tail.returncode == 0 and tail.stdout == "standin: failing at step 2\n"


def test_a_failed_run_shows_the_trainers_error_line(shim):
    host, _, workdir = shim
    why = "data.train_path /data/bad.jsonl:3 is not JSON (Expecting value)"
    res = host.run_cli(
        "train",
        "--no-push",
        "--detach",
        "--set",
        "run.steps=5",
        "--set",
        "standin.fail_at=2",
        "--set",
        f"standin.fail_error={why}",
    )
    run_id = res.stdout.strip()
    wait_until((run_dir(workdir, run_id) / "exit_code").exists, what="the run to fail")
    shown = host.run_cli("runs", "show", "shim", run_id, "--no-curves")
    assert shown.returncode == 0 and re.search(r"^reason +" + re.escape(why) + r" *$", shown.stdout, re.M), shown.stdout
    quiet = host.run_cli("train", "--no-push", "--detach", "--set", "run.steps=5", "--set", "standin.fail_at=2")
    wait_until((run_dir(workdir, quiet.stdout.strip()) / "exit_code").exists, what="the second run to fail")
    assert "reason" not in host.run_cli("runs", "show", "shim", quiet.stdout.strip()).stdout  # no error line: none


def follow_then(shim, signum: int):
    """Start `train --follow` (4 short steps), send signum to the client after step 2, then check
    that the run still succeeds and leaves no reader behind. Returns (exit code, stderr). The run
    holds after step 2 until the client has ended: it cannot finish first on a busy machine."""
    host, session, workdir = shim
    client = subprocess.Popen(
        [
            *CLI,
            "train",
            "--no-push",
            "--follow",
            "--set",
            "run.steps=4",
            "--set",
            "standin.step_time=0.05",
            "--set",
            "standin.hold_at=2",
        ],
        env=host.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        log = wait_until(lambda: next((workdir / "runs").glob("*/train.log"), None), what="the run's log")
        wait_until(lambda: b"standin: holding after step 2" in log.read_bytes(), what="a few steps")
        client.send_signal(signum)
        _, err = client.communicate(timeout=30)
    finally:
        client.kill()
    (log.parent / "standin-release").touch()
    done = log.parent / "exit_code"
    wait_until(done.exists, what="the run to finish without its client")
    assert done.read_text().strip() == "0" and b"standin: done" in log.read_bytes()
    assert state(session, log.parent.name) == "succeeded"
    wait_until(lambda: not readers(workdir), timeout=15, what="the remote log reader to exit")
    return client.returncode, err


def test_run_survives_killed_client(shim):
    code, _ = follow_then(shim, signal.SIGKILL)
    assert code == -signal.SIGKILL


def test_ctrl_c_detaches_and_the_run_goes_on(shim):
    """Ctrl-C while following: exit 130 with a re-attach hint; the run still finishes."""
    code, err = follow_then(shim, signal.SIGINT)
    assert code == 130, err
    assert b"logs tail" in err and b"Traceback" not in err


def test_stop_sigterm_within_grace_checkpoints(shim):
    _, session, workdir = shim
    run = start_run(session.target("shim"), gpus=GpuChoice((0,)), overrides=LONG)
    wait_until(lambda: b"step 1/" in (run_dir(workdir, run.run_id) / "train.log").read_bytes(), what="steps")
    info = stop_run(session.target("shim"), run.run_id[:-1], grace=30)
    assert info["state"] == "stopped" and info["exit_code"] == 143
    assert list((run_dir(workdir, run.run_id) / "checkpoints").glob("step-*.json"))
    again = stop_run(session.target("shim"), run.run_id, grace=30)
    assert again["already"] and again["state"] == "stopped"


def test_stop_kills_a_trainer_that_ignores_sigterm(shim):
    _, session, workdir = shim
    run = start_run(session.target("shim"), gpus=GpuChoice((0,)), overrides=[*LONG, "standin.ignore_sigterm=true"])
    wait_until(lambda: b"step 1/" in (run_dir(workdir, run.run_id) / "train.log").read_bytes(), what="steps")
    info = stop_run(session.target("shim"), None, grace=0.5)  # None: the latest run
    assert info["run_id"] == run.run_id and info["state"] == "stopped" and info["exit_code"] == 137
    assert b"ignoring SIGTERM" in (run_dir(workdir, run.run_id) / "train.log").read_bytes()


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("supervisor", ["alive", "killed"])
def test_stop_sigterms_the_trainer_alone_then_kills_its_group(shim, supervisor):
    """The trainer's helpers (the compiler's ptxas) keep running while it checkpoints, and die
    with its process group once it is gone; the same when `runs stop` finds the supervisor dead."""
    _, session, workdir = shim
    run = start_run(session.target("shim"), gpus=GpuChoice((0,)), overrides=[*LONG, "standin.helper=true"])
    log = run_dir(workdir, run.run_id) / "train.log"
    started = wait_until(
        lambda: b"step 1/" in log.read_bytes() and re.search(rb"helper pid (\d+)", log.read_bytes()),
        what="the helper and steps",
    )
    helper = int(started.group(1))
    if supervisor == "killed":
        os.kill(meta(workdir, run.run_id)["supervisor"]["pid"], signal.SIGKILL)
    info = stop_run(session.target("shim"), run.run_id, grace=30)
    assert info["state"] == "stopped" and info["exit_code"] == 143
    assert b"checkpoint saved" in log.read_bytes() and b"helper: got SIGTERM" not in log.read_bytes()
    wait_until(lambda: gone(helper), what="the helper to die with the trainer's group")


def test_gpu_conflict_is_atomic_and_names_the_holder(shim):
    _, session, _ = shim
    target = session.target("shim")

    def start(name: str):  # type: ignore[no-untyped-def]
        return lambda: start_run(target, gpus=GpuChoice((0, 1)), overrides=LONG, name=name)

    winner, (refused,) = race(start("first"), start("second"))  # names are unique
    assert winner.run_id in str(refused)
    with pytest.raises(ConflictError, match=winner.run_id):
        start_run(target, gpus=GpuChoice((1,)), overrides=LONG)
    other = start_run(target, gpus=GpuChoice((2,)), overrides=LONG)
    forced = start_run(target, gpus=GpuChoice((0,)), overrides=LONG, force=True)
    live = {r["run_id"] for r in list_runs(target) if r["state"] == "running"}
    assert live == {winner.run_id, other.run_id, forced.run_id}
    for run in (winner, other, forced):
        assert stop_run(target, run.run_id, grace=10)["state"] == "stopped"


def test_lost_when_supervisor_and_trainer_are_killed(shim):
    host, session, workdir = shim
    run = start_run(session.target("shim"), gpus=GpuChoice((0,)), overrides=LONG)
    info = meta(workdir, run.run_id)
    os.kill(info["supervisor"]["pid"], signal.SIGKILL)
    os.killpg(info["pgid"], signal.SIGKILL)
    wait_until(lambda: state(session, run.run_id) == "lost", what="state lost")
    res = host.run_cli("logs", "tail", "shim", run.run_id, "-f")
    assert res.returncode == 102 and "lost" in res.stderr
    start_run(session.target("shim"), gpus=GpuChoice((0,)), overrides=["run.steps=1"])  # a lost run holds no GPU


def test_run_selection_by_prefix_name_and_latest(shim, tmp_path):
    host, session, _ = shim
    target = session.target("shim")
    ids = [
        start_run(target, gpus=GpuChoice(cpu=True), overrides=["run.steps=2"], name=f"n{i}", force=True).run_id
        for i in range(3)
    ]
    wait_until(lambda: all(r["state"] == "succeeded" for r in list_runs(target)), what="runs to finish")
    for run_id in ids:
        prefix = next(run_id[:n] for n in range(1, len(run_id) + 1) if sum(o.startswith(run_id[:n]) for o in ids) == 1)
        assert show_run(target, prefix)["run_id"] == run_id
    assert show_run(target, None)["run_id"] == max(ids)
    assert show_run(target, "n1")["run_id"] == ids[1]
    with pytest.raises(UsageError) as ambiguous:
        show_run(target, ids[0][:4])
    assert all(i in str(ambiguous.value) for i in ids)
    with pytest.raises(NotFoundError):
        show_run(target, "zzz")
    png = tmp_path / "curves.png"
    only_run = host.run_cli("runs", "show", "n2", "--json", "--no-curves")  # a lone non-host argument: a run
    assert only_run.returncode == 0 and json.loads(only_run.stdout)["run_id"] == ids[2]
    missing = host.run_cli("runs", "stop", "zzz")
    assert missing.returncode == 5 and missing.stderr.strip().endswith(
        "'zzz' is neither a host in the inventory (hosts: bare, dock, dockstop, local, shim, stopped) nor a run on shim"
    )
    shown = host.run_cli("runs", "show", "shim", "n2", "--curves", "--plot", str(png))  # curves: a pipe's too
    assert ids[2] in shown.stdout and "teacher-forced (a proxy)" in shown.stdout  # details and text curves
    assert shown.returncode == 0 and png.read_bytes().startswith(b"\x89PNG") and f"wrote {png}" in shown.stdout
    bare_name = host.run_cli("runs", "show", "shim", "n2", "--no-curves", "--plot", str(tmp_path / "named"))
    assert bare_name.returncode == 0 and f"wrote {tmp_path / 'named.png'}" in bare_name.stdout  # the file written
    assert (tmp_path / "named.png").read_bytes().startswith(b"\x89PNG")
    as_json = host.run_cli("runs", "show", "shim", "n2", "--json", "--plot", str(tmp_path / "j.png"))
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["run_id"]  # stdout: the JSON only
    assert (tmp_path / "j.png").read_bytes().startswith(b"\x89PNG")  # it was silently not written
    unwritable = host.run_cli("runs", "show", "shim", "n2", "--plot", str(tmp_path / "x.txt"))
    assert (unwritable.returncode, unwritable.stdout) == (2, "")  # refused before the run's details
    # Without matplotlib (the plot extra): one line naming the extra, before anything is printed.
    env = {"PYTHONPATH": str(tmp_path / "no-mpl")}
    (tmp_path / "no-mpl").mkdir()
    (tmp_path / "no-mpl" / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    bare = host.run_cli("runs", "show", "shim", "n2", "--plot", str(tmp_path / "b.png"), env=env, process=True)
    assert bare.returncode == 2 and bare.stdout == "" and "dflashctl[plot]" in bare.stderr
    assert len(bare.stderr.splitlines()) == 1 and not (tmp_path / "b.png").exists()


@pytest.mark.parametrize(
    "name,message",
    [
        ("/nonexistent-dir/x.png", "error: --plot /nonexistent-dir/x.png: no such directory /nonexistent-dir"),
        ("x.txt", "error: --plot {tmp}/x.txt: matplotlib cannot write .txt files (use one of: avif, eps, "),
        ("sub.png", "error: --plot {tmp}/sub.png: is a directory"),
    ],
)
def test_a_plot_path_that_cannot_be_written_is_refused_before_anything_is_printed(sshd_host, tmp_path, name, message):
    (tmp_path / "sub.png").mkdir()
    path = name if name.startswith("/") else str(tmp_path / name)
    result = sshd_host.run_cli("runs", "show", "shim", "no-such-run", "--plot", path)  # the run is never looked up
    assert (result.returncode, result.stdout) == (2, "")
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(message.format(tmp=tmp_path))


def test_shell_completion_offers_the_hosts_run_ids_and_names(shim):
    host, session, _ = shim
    target = session.target("shim")
    ids = [
        start_run(target, gpus=GpuChoice(cpu=True), overrides=["run.steps=1"], name=name, force=True).run_id
        for name in ("alpha", "beta")
    ]
    wait_until(lambda: all(r["state"] == "succeeded" for r in list_runs(target)), what="runs to finish")

    def complete(words: str) -> list[str]:
        env = {
            "_DFLASHCTL_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1),
        }
        result = host.run_cli(env=env)
        assert result.returncode == 0 and result.stderr == ""
        return result.stdout.split()

    assert complete("dflashctl logs tail shim ") == [ids[1], "beta", ids[0], "alpha"]  # newest first
    assert complete("dflashctl runs show shim al") == ["alpha"]
    assert complete(f"dflashctl runs stop shim {ids[0]}") == [ids[0]]
    assert complete("dflashctl logs tail stopped ") == []  # container stopped: nothing, and no error


def test_local_runs_without_gpus_conflict_unless_forced(tmp_path):
    workdir = tmp_path / "work"
    install_standin(workdir / "payload")
    with local_session(workdir) as session:
        target = session.target(None)
        try:
            first = start_run(target, gpus=parse_gpus(None, target.host.gpus), overrides=LONG)
            with pytest.raises(ConflictError, match=first.run_id):
                start_run(target, gpus=GpuChoice(cpu=True), overrides=LONG)
            forced = start_run(target, gpus=GpuChoice(cpu=True), overrides=["run.steps=1"], force=True)
            assert forced.run_id != first.run_id
            assert stop_run(target, first.run_id, grace=10)["state"] == "stopped"
        finally:
            kill_leftovers(workdir)


TINY = [
    "data.source=random",
    "run.log_every=1",
    "data.num_train=8",
    "data.num_eval=2",
    "data.batch_size=2",
    "run.eval_batches=1",
]


def test_real_trainer_follow_then_stop_checkpoints(shim):
    """The real trainer's tiny config through push, start, follow and stop (SIGTERM -> checkpoint)."""
    from dflashctl.logs import read_log
    from dflashctl.payload import push

    _, session, workdir = shim
    target = session.target("shim")
    pushed = push(target)
    run = start_run(
        target, gpus=GpuChoice(cpu=True), overrides=[*TINY, "run.steps=100000"], payload_hash=pushed.manifest_hash
    )
    got = bytearray()
    stopped: list[dict] = []
    stopper = threading.Thread(target=lambda: stopped.append(stop_run(session.target("shim"), run.run_id, 120)))

    def sink(data: bytes) -> None:
        got.extend(data)
        if not stopper.is_alive() and not stopped and b"step 2/100000" in got:
            stopper.start()  # stop while following: the follow must end with the run

    ending = read_log(session, "shim", run.run_id, on_data=sink, follow=True, lines=-1)
    stopper.join(150)
    assert ending.state == "stopped" and ending.exit_code == 143 and stopped[0]["state"] == "stopped"
    rdir = run_dir(workdir, run.run_id)
    hint = f"dflashctl train shim --resume {run.run_id}".encode()
    assert bytes(got) == (rdir / "train.log").read_bytes() and hint in got
    (saved,) = list((rdir / "checkpoints").glob("step_*"))
    records = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "total_steps", "loss"} <= set(records[-1]) and meta(workdir, run.run_id)["payload_hash"]

    # --resume: the same run, running again from its checkpoint, with its own config.
    step = int(saved.name.split("_")[1])
    again = resume_run(target, run.run_id, payload_hash=pushed.manifest_hash)
    assert again.run_id == run.run_id and state(session, run.run_id) == "running"
    wait_until(lambda: f"resuming from {saved} at step {step}" in (rdir / "train.log").read_text(), 120, "resume")
    wait_until(lambda: f"step {step + 2}/100000" in (rdir / "train.log").read_text(), 120, "a step after resume")
    assert stop_run(target, run.run_id, grace=120)["state"] == "stopped"
    info = meta(workdir, run.run_id)
    assert info["resumes"] == 1 and info["argv"].count("--resume") == 1


def test_the_terminal_curves_draw_the_speculative_tau_and_call_the_proxy_a_proxy():
    from dflashctl.plot import terminal_plot

    records = [{"event": "train", "step": s, "loss": 5.0 - s / 100} for s in range(10, 110, 10)]
    records += [
        {"event": "eval", "step": s, "loss": 4.5, "acceptance_length": 1.5, "spec_tau_prompt_mean": 5.0}
        for s in (10, 50, 100)
    ]
    drawing = terminal_plot(records)
    titles = drawing.splitlines()[0].split("  ")
    # The proxy (1.5 here) was drawn as "acceptance length" beside a tau of 5.0 that was not drawn.
    assert [t.strip() for t in titles if t.strip()] == ["training loss", "speculative tau", "teacher-forced (a proxy)"]
    assert "5.0" in drawing


def test_the_png_curves_get_the_held_out_loss_of_the_eval_records():
    from dflashctl.plot import held_out, series

    records = [{"event": "train", "step": 10, "loss": 4.0}, {"event": "eval", "step": 10, "loss": 6.0}]
    records.append({"event": "final", "step": 20, "loss": 5.5, "acceptance_length": 1.2})
    assert series(records, "loss") == ([10], [4.0])  # training loss: the training records only
    assert held_out(records, "loss") == ([10, 20], [6.0, 5.5])  # was always empty: no held-out line
