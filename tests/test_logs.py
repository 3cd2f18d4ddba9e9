"""`logs tail` and following: exact bytes across dropped SSH connections and log rotation, no
orphaned readers. Through real sshd + the pct shim where a connection matters, `local` otherwise."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import threading
from pathlib import Path

from runs_helpers import install_standin, local_session, readers, run_dir, wait_until
from sshd import CLI, SHIM_VMID

from rich.console import Console

from dflashctl.devices import GpuChoice
from dflashctl.logs import Cursor, LogView, Reconnect, parse_frames, progress_text, read_log
from dflashctl.remote.runctl.common import marker
from dflashctl.runs import start_run

FAST = Reconnect(delays=(0.05, 0.1, 0.2), max_delay=0.5, give_up_s=30, stall_s=5)


class FakeRun:
    """A run directory written by the test itself, 'alive' while a sleep process we own runs."""

    def __init__(self, workdir: Path, run_id: str = "20261130-000000-beef"):
        self.dir = run_dir(workdir, run_id)
        self.dir.mkdir(parents=True)
        self.keeper = subprocess.Popen(["sleep", "300"])
        meta = {"run_id": run_id, "name": None, "gpus": ["cpu"], "started_ts": 0, "supervisor": marker(self.keeper.pid)}
        (self.dir / "run.json").write_text(json.dumps(meta))
        self.log = (self.dir / "train.log").open("ab", buffering=0)

    def write(self, data: bytes) -> None:
        self.log.write(data)

    def rotate(self) -> None:
        """train.log -> train.log.1, the writer reopens a new train.log."""
        os.rename(self.dir / "train.log", self.dir / "train.log.1")
        self.log = (self.dir / "train.log").open("ab", buffering=0)

    def finish(self, code: int = 0) -> None:
        (self.dir / "exit_code").write_text(f"{code}\n")
        self.keeper.kill()
        self.keeper.wait()


def collect(session, selector, **kw):  # type: ignore[no-untyped-def]
    """Run read_log and return (bytes received, ending)."""
    got = bytearray()
    ending = read_log(session, None, selector, on_data=got.extend, policy=FAST, **kw)
    return bytes(got), ending


def test_parse_frames_handles_split_input():
    wire = b"".join(k + struct.pack(">I", len(p)) + p for k, p in [(b"D", b"abc"), (b"H", b""), (b"D", b"\n")])
    buf, frames = bytearray(), []
    for i in range(len(wire)):
        buf.extend(wire[i : i + 1])
        frames += parse_frames(buf)
    assert frames == [(b"D", b"abc"), (b"H", b""), (b"D", b"\n")] and not buf


def test_progress_text_shows_step_loss_acceptance_eta():
    record = {"step": 50, "total_steps": 200, "loss": 1.23456, "acceptance_length": 3.2}
    record |= {"tokens_per_s": 12345.6, "step_time_s": 2.0}
    text = progress_text(record).plain
    # The acceptance is the teacher-forced proxy: a bare `accept 3.20` read as the tau a user gets.
    assert text == "step 50/200 (25%)  loss 1.2346  teacher-forced accept 3.20  12,346 tok/s  ETA 5:00"
    # The in-training speculative tau (merged from eval records by runctl) is shown beside it, marked
    # `~` as `runs list` marks it; its mean of per-prompt tau first, the pooled one for older runs.
    text = progress_text({**record, "spec_tau": 1.2, "spec_tau_prompt_mean": 1.5}).plain
    assert "teacher-forced accept 3.20  tau ~1.50  12,346 tok/s" in text
    assert "tau ~1.20  " in progress_text({**record, "spec_tau": 1.2, "spec_tau_prompt_mean": None}).plain


def test_tail_lines_and_since_step_on_local(tmp_path):
    run = FakeRun(tmp_path)
    lines = [f"step {i}/9 loss {i}\n".encode() for i in range(10)] + [b"no step here\n", b"last, no newline"]
    run.write(b"".join(lines))
    run.finish(3)
    with local_session(tmp_path) as session:
        got, ending = collect(session, None, lines=2)
        assert got == b"no step here\nlast, no newline" and ending.state == "failed" and ending.exit_code == 3
        assert collect(session, "2026", since_step=8)[0] == b"".join(lines[8:])
        assert collect(session, None, lines=0)[0] == b""
        assert collect(session, None, lines=1000)[0] == b"".join(lines)


def test_follow_across_rotation_and_reconnect_in_the_rotated_file(tmp_path):
    run = FakeRun(tmp_path)
    expected = bytearray()

    def write(data: bytes) -> None:
        run.write(data)
        expected.extend(data)

    write(b"before rotation 1\n")
    with local_session(tmp_path) as session:
        got = bytearray()
        seen = threading.Event()

        def sink(data: bytes) -> None:
            got.extend(data)
            seen.set()

        result: list = []
        reader = threading.Thread(
            target=lambda: result.append(
                read_log(session, None, None, on_data=sink, follow=True, lines=-1, policy=FAST)
            )
        )
        reader.start()
        wait_until(seen.is_set, what="the first bytes")
        run.rotate()
        write(b"new file line 1\n")
        write(b"new file line 2\n")
        wait_until(lambda: bytes(got) == bytes(expected), what="lines after rotation")
        run.finish(0)
        reader.join(30)
        assert result and result[0].state == "succeeded" and bytes(got) == bytes(expected)

        # A client that was cut off inside the old file resumes there, then moves to the new one.
        old_inode = os.stat(run.dir / "train.log.1").st_ino
        cursor = Cursor(run_id=run.dir.name, inode=old_inode, offset=len(b"before "))
        rest = bytearray()
        read_log(session, None, None, on_data=rest.extend, follow=True, lines=-1, policy=FAST, cursor=cursor)
        assert bytes(rest) == bytes(expected)[len(b"before ") :]


def test_follow_survives_killed_ssh_connections_exactly(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    with shim_host.session() as session:
        run = start_run(
            session.target("shim"),
            gpus=GpuChoice((0,)),
            overrides=["run.steps=40", "standin.step_time=0.05", "standin.lines=40"],
        )
        got = bytearray()
        kills: list[int] = []

        def sink(data: bytes) -> None:
            got.extend(data)
            # Drop the connection twice, mid-stream, from inside the data path.
            if len(kills) < 2 and len(got) > 20_000 * (len(kills) + 1):
                kills.append(shim_host.kill_connections())

        ending = read_log(session, "shim", run.run_id, on_data=sink, follow=True, lines=-1, policy=FAST)
    assert kills and all(kills) and len(kills) == 2
    assert ending.state == "succeeded" and ending.exit_code == 0
    assert bytes(got) == (run_dir(workdir, run.run_id) / "train.log").read_bytes()
    wait_until(lambda: not readers(workdir), timeout=15, what="orphaned readers to exit")


def test_no_reader_left_when_following_client_is_killed(shim_host):
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    install_standin(workdir / "payload")
    with shim_host.session() as session:
        run = start_run(
            session.target("shim"), gpus=GpuChoice((0,)), overrides=["run.steps=100000", "standin.step_time=0.2"]
        )
    client = subprocess.Popen(
        [*CLI, "logs", "tail", "shim", run.run_id, "-f"],
        env=shim_host.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert client.stdout.readline().startswith(b"standin: pid")  # following for real
        assert readers(workdir)
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    wait_until(lambda: not readers(workdir), timeout=15, what="the reader to exit after its client died")
    pid = json.loads((run_dir(workdir, run.run_id) / "run.json").read_text())["pgid"]
    os.killpg(pid, signal.SIGTERM)
    wait_until((run_dir(workdir, run.run_id) / "exit_code").exists, what="the stand-in to end")


def test_terminal_view_prints_whole_lines_above_the_progress_line():
    screen = io.StringIO()
    view = LogView(io.BytesIO(), Console(file=screen, force_terminal=True, width=120, color_system=None))
    view.write("step 1 ü".encode()[:-1])  # a line split inside a UTF-8 character
    view.write("ü".encode()[-1:] + b"\nstep 2 [bold]x[/]\npartial")
    view.metrics({"step": 2, "total_steps": 4, "loss": 0.5})
    view.close()
    text = screen.getvalue()
    assert "step 1 ü" in text and "step 2 [bold]x[/]" in text and "partial" in text


def test_backoff_grows_across_drops_that_bring_no_log_bytes(shim_host):
    """A reader that answers and dies again without sending log bytes is no recovery: the next
    wait is longer (it used to restart at the first delay: a new SSH login every 0.2 s). Each drop
    is the remote reader killed in the container, which ends its SSH channel."""
    workdir = shim_host.container_dir(SHIM_VMID) / "work"
    run = FakeRun(workdir)
    run.write(b"line one\n")
    notices: list[str] = []
    policy = Reconnect(delays=(0.1, 0.3, 0.9), max_delay=2.0, give_up_s=60, stall_s=20)
    done: list[object] = []
    got = bytearray()

    def follow() -> None:
        with shim_host.session() as session:
            done.append(
                read_log(
                    session,
                    "shim",
                    None,
                    on_data=got.extend,
                    on_notice=notices.append,
                    follow=True,
                    lines=-1,
                    policy=policy,
                )
            )

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    killed: set[int] = set()
    try:
        wait_until(lambda: got == b"line one\n", 30, "the log")  # the reader knows the run now
        for drop in range(3):
            pid = wait_until(lambda: next((p for p in readers(workdir) if p not in killed), None), 30, "a reader")
            killed.add(pid)
            os.kill(pid, signal.SIGKILL)  # the connection's end, before any new log byte
            wait_until(lambda: len(notices) > drop, 30, f"notice {drop + 1}")
    finally:
        run.finish()
        reader.join(60)
    delays = [n.split("reconnecting in ")[1] for n in notices[:3]]
    assert delays == ["0.1 s", "0.3 s", "0.9 s"] and done and done[0].state == "succeeded"


def test_progress_text_of_a_data_run_shows_rows():
    text = progress_text({"rows_done": 30, "rows_total": 120, "rows_failed": 2, "tokens_per_s": 1234.4, "eta_s": 75})
    assert text.plain == "rows 30/120 (25%)  2 failed  1,234 tok/s  ETA 1:15"
    early = progress_text(
        {
            "rows_done": 8,
            "rows_total": 120,
            "rows_failed": 0,
            "tokens_per_s": 99.6,
            "eta_s": 900,
            "rate_includes_start_up": True,
        }
    )
    assert early.plain == "rows 8/120 (7%)  0 failed  100 tok/s incl. start-up  ETA 15:00"
