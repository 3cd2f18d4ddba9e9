"""`dflashctl runs pull`: a run's directory copied out of the container through real sshd + pct shim.

Copies must be byte-exact, checkpoints only as asked, and atomic: an existing destination, a bad
run, a stopped container or a connection dropped mid-stream leave no directory behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from runs_helpers import alive, install_standin, pids_where
from sshd import SHIM_VMID
from test_eval import local_env
from test_exec import one_line_error

from dflashctl.containers import Target
from dflashctl.errors import ConnectError, Interrupted, RemoteError
from dflashctl.inventory import HostSpec
from dflashctl.pull import pull_run
from dflashctl.transport import LocalTransport

MB = 1 << 20


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under root."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def finished_run(shim_host, tmp_path) -> tuple[str, Path]:
    """A succeeded stand-in run on `shim` with an export, odd file names and three checkpoints."""
    source = install_standin(tmp_path / "payload_src")
    res = shim_host.run_cli(
        "train", "shim", "--source", str(source), "--follow", "--name", "p1", "--set", "run.steps=2"
    )
    assert res.returncode == 0, res.stderr
    run_id = res.stderr.split("started run ")[1].split()[0]
    run_dir = shim_host.container_dir(SHIM_VMID) / "work" / "runs" / run_id
    (run_dir / "export").mkdir()
    (run_dir / "export" / "model.safetensors").write_bytes(os.urandom(3 * MB))
    (run_dir / "export" / "name with spaces 'q' ü.json").write_text("{}")
    for step in (2, 10, 9):
        ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / ".tmp-step_00000011").mkdir()  # a checkpoint being written
    (run_dir / "link").symlink_to("/etc/passwd")  # links are not followed or copied
    return run_id, run_dir


def test_pull_copies_the_run_without_checkpoints_byte_exact(shim_host, tmp_path, finished_run):
    run_id, run_dir = finished_run
    res = shim_host.run_cli("runs", "pull", "shim", "p1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    pulled = tmp_path / run_id
    expected = {k: v for k, v in tree(run_dir).items() if not k.startswith("checkpoints/")}
    assert tree(pulled) == expected and "export/name with spaces 'q' ü.json" in expected
    assert not (pulled / "link").exists() and not (pulled / "checkpoints").exists()
    assert res.stderr.startswith(f"pulled run {run_id} (succeeded) from shim (pct 200) to {pulled}: ")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial directory left


@pytest.mark.parametrize(
    "which,steps", [("latest", ["step_00000010"]), ("all", ["step_00000002", "step_00000009", "step_00000010"])]
)
def test_pull_checkpoints_latest_or_all(shim_host, tmp_path, finished_run, which, steps):
    run_id, run_dir = finished_run
    res = shim_host.run_cli("runs", "pull", run_id[:-3], "--to", str(tmp_path / "out"), "--checkpoints", which)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == steps
    expected = {k: v for k, v in tree(run_dir / "checkpoints").items() if k.split("/")[0] in steps}
    assert tree(tmp_path / "out" / "checkpoints") == expected


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["runs", "pull", "shim", "zzz"], 5, "error: shim (pct 200): no runs yet"),
        (
            ["runs", "pull", "stopped"],
            4,
            "error: stopped: container 201 is not running (start it with `pct start 201`)",
        ),
        (
            ["runs", "pull", "--checkpoints", "some"],
            2,
            "error: --checkpoints must be one of none, latest, all, got 'some'",
        ),
    ],
)
def test_pull_errors_are_one_line_and_leave_nothing(shim_host, tmp_path, args, code, message):
    res = shim_host.run_cli(*args, "--to", str(tmp_path / "out"))
    assert res.returncode == code and one_line_error(res) == message
    assert list(tmp_path.iterdir()) == []


def test_pull_never_overwrites(shim_host, tmp_path, finished_run):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    res = shim_host.run_cli("runs", "pull", "--to", str(dest))
    assert (
        res.returncode == 2 and one_line_error(res) == f"error: {dest} already exists: pull into a new directory (--to)"
    )
    assert tree(dest) == {"mine.txt": hashlib.sha256(b"keep").hexdigest()}


def test_a_destination_under_a_file_is_a_usage_error(shim_host, tmp_path, finished_run):
    """`--to afile/x` was an internal error (FileExistsError)."""
    (tmp_path / "afile").write_text("mine")
    res = shim_host.run_cli("runs", "pull", "--to", str(tmp_path / "afile" / "x"))
    assert res.returncode == 2
    assert (
        one_line_error(res)
        == f"error: cannot pull into {tmp_path / 'afile' / 'x'}: {tmp_path / 'afile'} is not a directory"
    )
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_write_that_fails_here_is_one_line_and_keeps_nothing(shim_host, tmp_path, finished_run):
    """This machine refuses the files (here: a file size limit, as a full or read-only disk would):
    one line naming the reason, exit 1, no partial directory left; it was an internal error."""
    import subprocess

    from sshd import CLI

    limited = ["sh", "-c", 'ulimit -f 2 && exec "$@"', "sh", *CLI]  # 1 KiB: smaller than the run's files
    dest = tmp_path / "pulls" / "out"
    res = subprocess.run(
        [*limited, "runs", "pull", "--to", str(dest)], env=shim_host.env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1
    assert one_line_error(res) == (
        f"error: cannot write the pulled files under {dest.parent}: File too large; nothing was kept at {dest}"
    )
    assert list(dest.parent.iterdir()) == []


def test_dropped_connection_mid_pull_keeps_nothing(shim_host, tmp_path, finished_run):
    _, run_dir = finished_run
    (run_dir / "export" / "big.bin").write_bytes(os.urandom(24 * MB))
    struck = []

    def strike(done: int, total: int) -> None:
        if done > 2 * MB and not struck:
            struck.append(shim_host.kill_connections())

    here = tmp_path / "here"
    here.mkdir()
    with shim_host.session() as session:
        with pytest.raises(ConnectError, match="lost.* during pull; nothing was kept at .*out, run it again"):
            pull_run(session.target("shim"), "p1", here / "out", on_bytes=strike)
    assert struck and struck[0] >= 1
    assert list(here.iterdir()) == []


def test_ctrl_c_mid_pull_stops_the_remote_pack_before_the_pull_returns(shim_host, tmp_path, finished_run):
    """Ctrl-C of a pull closed the channel and left `runctl pack` to die of it at its next write; one
    that did not write (here stopped, as one reading a slow disk, or under `docker exec`, whose
    command outlives its client) ran on. Now it is stopped on the host, as an exec's command is."""
    _, run_dir = finished_run
    (run_dir / "export" / "big.bin").write_bytes(os.urandom(24 * MB))
    packs: list[int] = []

    def ctrl_c(done: int, total: int) -> None:
        if done > 2 * MB:  # the pack has 22 MB left to send: it is there, blocked on this reader
            packs.extend(_packs(run_dir.parents[1]))
            for pid in packs:
                os.kill(pid, signal.SIGSTOP)
            raise Interrupted()  # what the CLI's SIGINT handler raises

    here = tmp_path / "here"
    here.mkdir()
    try:
        with shim_host.session() as session:
            with pytest.raises(Interrupted):
                pull_run(session.target("shim"), "p1", here / "out", on_bytes=ctrl_c)
            assert packs and not [pid for pid in packs if alive(pid)]
        assert list(here.iterdir()) == []
    finally:
        for pid in packs:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_pack_that_could_not_be_stopped_is_reported(shim_host, tmp_path, finished_run):
    """A Ctrl-C whose stop fails (here the host's interpreter refuses the guard's `stop`) says that
    the pack may still run, as exec's line does, rather than implying that nothing is left."""
    import shlex

    from sshd import SHIM_VMID

    _, run_dir = finished_run
    (run_dir / "export" / "big.bin").write_bytes(os.urandom(24 * MB))
    python = tmp_path / "python"  # argv: -S -c SOURCE ACTION TOKEN for the guard's own calls
    refuse = '[ "$4" = stop ] && { echo "stop refused" >&2; exit 1; }'
    python.write_text(f'#!/bin/sh\n{refuse}\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    entry = shim_host.host_entry(SHIM_VMID, python=str(python))
    inventory = shim_host.write_inventory(tmp_path / "hosts.yaml", {"refuses": entry})
    packs: list[int] = []

    def ctrl_c(done: int, total: int) -> None:
        if done > 2 * MB:
            packs.extend(_packs(run_dir.parents[1]))
            raise Interrupted()

    try:
        with shim_host.session(inventory=inventory) as session:
            with pytest.raises(Interrupted) as info:
                pull_run(session.target("refuses"), "p1", tmp_path / "out", on_bytes=ctrl_c)
        line = "interrupted; refuses (pct 200): the command may still run (its stop failed: stop refused)"
        assert str(info.value) == line
        assert packs and not (tmp_path / "out").exists()
    finally:
        for pid in packs:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _packs(workdir: Path) -> list[int]:
    """The processes that run `runctl pack` for workdir (the program, not a guard around it)."""
    wanted = [b"runctl", b"pack", os.fsencode(workdir)]

    def pack(parts: list[bytes]) -> bool:
        at = parts.index(b"-c") if b"-c" in parts else -1
        return at >= 0 and parts[at + 3 : at + 6] == wanted

    return pids_where(pack)


def test_a_hostile_tar_is_refused(tmp_path):
    """A compromised container answering with `../` in the tar cannot write outside the destination."""
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    fake = tmp_path / "fake-python"
    header = json.dumps({"run_id": "r1", "state": "succeeded", "files": 1, "bytes": 3})
    answer = header.encode() + b"\n" + payload.getvalue()
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write({answer!r})\n")
    fake.chmod(0o755)
    target = Target(HostSpec(name="evil", transport="local", python=str(fake), workdir=str(tmp_path)), LocalTransport())
    (tmp_path / "dest").mkdir()
    with pytest.raises(RemoteError, match=r"refusing tar member '\.\./escaped\.txt'"):
        pull_run(target, "r1", tmp_path / "dest" / "out")
    assert not (tmp_path / "dest" / "escaped.txt").exists() and list((tmp_path / "dest").iterdir()) == []


def _front_matter(card: str) -> dict:
    """The YAML between the card's leading `---` lines (the Hub's metadata block)."""
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _real_export(into: Path, gpu: str) -> None:
    """The trainer's own export of a tiny drafter, its header then stamped with `gpu` as
    export.py stamps it on CUDA (this machine has none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote_payload"))
    try:
        from dflash_train.config import load_config
        from dflash_train.export import export_drafter
        from dflash_train.model import DFlashDrafter
        from dflash_train.plan import resolve_run
        from dflash_train.resolve import drafter_spec
    finally:
        sys.path.pop(0)
    from safetensors.torch import load_file, save_file

    cfg = resolve_run(load_config(overrides=[f"run.output_dir={into.parent}"]), cuda_count=0).cfg
    export_drafter(DFlashDrafter(drafter_spec(cfg)), cfg.target, into)
    weights = into / "model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt", "gpu": gpu})


def test_pull_writes_a_hub_model_card_into_the_export(shim_host, tmp_path, finished_run):
    """Issue 28: README.md in the pulled export, with the Hub's front matter; base_model from
    the run's target.path when that is a Hub name; the GPU export.py recorded; eval not run yet."""
    run_id, run_dir = finished_run
    shutil.rmtree(run_dir / "export")
    _real_export(run_dir / "export", "NVIDIA H200")
    (run_dir / "config.resolved.yaml").write_text(
        "preset: real-target\ntarget: {path: Qwen/Qwen3-8B, num_layers: 6, hidden_size: 64}\n"
        "data: {source: jsonl, train_path: /root/data/regen.jsonl, eval_fraction: 0.05}\n"
    )
    res = shim_host.run_cli("runs", "pull", "shim", "p1", "--to", str(tmp_path / "out"), "--license", "apache-2.0")
    assert res.returncode == 0, res.stderr
    card_path = tmp_path / "out" / "export" / "README.md"
    assert res.stderr.splitlines()[-1] == f"model card: {card_path}"
    card = card_path.read_text()
    assert _front_matter(card) == {
        "license": "apache-2.0",
        "base_model": "Qwen/Qwen3-8B",
        "library_name": "transformers",
        "tags": ["dflash", "speculative-decoding", "block-diffusion", "draft-model", "dflashctl"],
        "pipeline_tag": "text-generation",
    }
    assert "speculative decoding of **Qwen/Qwen3-8B**" in card
    assert "- source: JSON lines `/root/data/regen.jsonl`, 0.05 held out" in card
    assert "- steps: 2 of 2 steps; final training loss 4.1667" in card  # the stand-in's last record
    assert "- trained on: NVIDIA H200 (host `shim`)" in card
    assert "- `dflashctl eval`: not run before this pull" in card
    assert "- vLLM: meets them\n- SGLang: meets them\n- z-lab DFlashDraftModel: meets them" in card
    assert '"num_speculative_tokens": 7' in card and "--speculative-num-draft-tokens 8" in card
    assert f"`runs pull` of run `{run_id}`" in card and "Written by dflashctl 0.1.0" in card


def test_the_model_card_names_the_base_model_given_or_says_it_is_left_out(shim_host, tmp_path, finished_run):
    _, run_dir = finished_run
    shutil.rmtree(run_dir / "export")
    _real_export(run_dir / "export", "NVIDIA H200")
    (run_dir / "config.resolved.yaml").write_text("preset: real-target\ntarget: {path: /models/Qwen3-8B}\n")
    res = shim_host.run_cli("runs", "pull", "shim", "p1", "--to", str(tmp_path / "a"))
    assert res.returncode == 0 and res.stderr.splitlines()[-1].endswith(
        "(base_model left out of the model card (the target was /models/Qwen3-8B): "
        "pass --base-model ORG/NAME to name it)"
    )
    assert "base_model" not in _front_matter((tmp_path / "a" / "export" / "README.md").read_text())
    res = shim_host.run_cli("runs", "pull", "shim", "p1", "--to", str(tmp_path / "b"), "--base-model", "Qwen/Qwen3-8B")
    card = (tmp_path / "b" / "export" / "README.md").read_text()
    assert res.returncode == 0 and _front_matter(card)["base_model"] == "Qwen/Qwen3-8B"
    assert "- target: `/models/Qwen3-8B`" in card and _front_matter(card)["license"] == "other"


def test_the_card_of_an_eval_from_before_the_per_prompt_mean_has_its_pooled_tau(shim_host, tmp_path, finished_run):
    """An eval.json written before `tau_prompt_mean` existed (pooled tau only): the card was not
    written (a KeyError); now it gives the pooled figures it has, the baseline's speedup named."""
    _, run_dir = finished_run
    shutil.rmtree(run_dir / "export")
    _real_export(run_dir / "export", "NVIDIA H200")
    old = {"tau": 2.5, "speedup": 1.8, "identical": True, "device": "NVIDIA H200", "max_new_tokens": 64}
    (run_dir / "eval.json").write_text(json.dumps({**old, "baseline": {"tau": 1.5, "speedup": 1.2}}))
    res = shim_host.run_cli("runs", "pull", "shim", "p1", "--to", str(tmp_path / "out"))
    assert res.returncode == 0 and res.stderr.splitlines()[-1].startswith("model card: "), res.stderr
    card = (tmp_path / "out" / "export" / "README.md").read_text()
    assert "NVIDIA H200): tau 2.500 pooled (as SpecForge's benchmarks report); output identical" in card
    assert "- free baseline, prompt lookup on the same decode path: tau 1.500 pooled, speedup over the" in card


def test_a_card_that_cannot_be_written_does_not_undo_the_pull(shim_host, tmp_path, finished_run):
    _, run_dir = finished_run
    (run_dir / "export" / "config.json").write_text("{not json")
    res = shim_host.run_cli("runs", "pull", "shim", "p1", "--to", str(tmp_path / "out"))
    assert res.returncode == 0 and res.stderr.splitlines()[-1].startswith("model card not written: ")
    assert (tmp_path / "out" / "export" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "export" / "README.md").exists()


@pytest.mark.slow
def test_the_model_card_of_a_real_run_has_both_tau_figures_and_the_speedup(shim_host, tmp_path):
    """A real tiny run through `local`: trained, evaluated with `dflashctl eval`, pulled; the card
    holds the training log's in-training figures and eval.json's, each labelled."""
    env = local_env(tmp_path)
    brief = [
        "--set",
        "run.steps=4",
        "--set",
        "run.log_every=2",
        "--set",
        "run.eval_every=4",
        "--set",
        "run.checkpoint_every=4",
        "--follow",
    ]
    assert shim_host.run_cli("train", "local", "--name", "mc", *brief, env=env, timeout=300).returncode == 0
    res = shim_host.run_cli(
        "eval", "local", "mc", "--count", "2", "--max-new-tokens", "8", "--json", env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    mine = tmp_path / "mine.jsonl"  # an eval on other prompts is a line of its own, not the default's
    mine.write_text(json.dumps({"input_ids": [5, 9, 11, 3]}) + "\n")
    res = shim_host.run_cli(
        "eval", "local", "mc", "--prompts", str(mine), "--max-new-tokens", "8", "--json", env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    other = json.loads(res.stdout)
    res = shim_host.run_cli("runs", "pull", "local", "mc", "--to", str(tmp_path / "out"), env=env)
    assert res.returncode == 0, res.stderr
    card = (tmp_path / "out" / "export" / "README.md").read_text()
    final = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["event"] == "final"
    assert f"with the true context): {final['acceptance_length']:.3f}" in card
    assert (
        f"(real draft-and-verify decoding, greedy, 4 held-out prompts x 32 tokens): "
        f"{final['spec_tau_prompt_mean']:.3f} mean of "
        f"per-prompt tau, {final['spec_tau']:.3f} pooled over all verify steps"
    ) in card
    assert (
        f"- `dflashctl eval` (greedy, 2 prompts x up to 8 new tokens, on cpu): tau {report['tau_prompt_mean']:.3f} "
        f"mean of per-prompt tau (as z-lab's benchmark.py reports), {report['tau']:.3f} pooled"
    ) in card
    assert f"- speedup over the target alone (`dflashctl eval`, the same machine): {report['speedup']:.2f}x" in card
    assert (
        f"- `dflashctl eval --prompts` on `mine` (greedy, 1 prompts x up to 8 new tokens, on cpu): tau "
        f"{other['tau_prompt_mean']:.3f} mean of per-prompt tau"
    ) in card
    # Each eval line says which prompts gave its tau: the --prompts file by name, rows and sha256.
    sha = hashlib.sha256(mine.read_bytes()).hexdigest()
    assert f"yes; prompts: --prompts mine.jsonl (1 rows, sha256 {sha})\n" in card
    assert "yes; prompts: the held-out split of the demo data (seed 0)\n" in card
    assert "- trained on: CPU (host `local`)" in card and "- steps: 4 of 4 steps" in card
    assert "- source: the target's own greedy continuations of random prompts (the demo data)" in card
    assert "base_model" not in _front_matter(card)
