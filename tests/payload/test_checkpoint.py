"""Checkpoint files (issue 31): the copy to host memory keeps its step's state while training changes
the originals, the buffers are reused, a crash in the middle of a write leaves nothing that
--resume would take, a durable write is on the disk before it is published, a failed background
write is raised where the run waits for it, and a checkpoint written before issue 31 still loads.
The end-to-end paths: tests/payload/test_train.py."""

import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.checkpoint import checkpoint_state, latest_checkpoint, load_checkpoint, write_checkpoint
from dflash_train.checkpoint_writer import RESERVE_PAUSE_S, CheckpointWriter, CheckpointWriteError
from dflash_train.host_copy import HostBuffers
from dflash_train.faults import InjectedFault

CPU = torch.device("cpu")
OLD = Path(__file__).resolve().parent / "golden" / "old_checkpoint"
SHARDS = [f"optimizer-{k}.safetensors" for k in range(4)]


def trained(steps: int = 1):
    """A small model with fixed weights, AdamW and LambdaLR after `steps` steps of unit gradients
    (the recipe tests/payload/golden/old_checkpoint was written from)."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3) / 10)
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return model, opt, sched


def host_state(step, model, opt, sched, buffers=None):
    """The checkpoint state of `step` copied into host buffers, as the writer takes it."""
    live = checkpoint_state(step, model, opt, sched, {"preset": "test"}, CPU)
    (live.weights, live.optim), _ = (buffers or HostBuffers()).copy((live.weights, live.optim), CPU)
    return live


def assert_same_training_state(a, b):
    (model_a, opt_a, sched_a), (model_b, opt_b, sched_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        state_a, state_b = opt_a.state[pa], opt_b.state[pb]
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert sched_a.state_dict() == sched_b.state_dict()


def test_the_host_copy_keeps_its_steps_state_while_training_goes_on(tmp_path):
    model, opt, sched = trained(2)
    state = host_state(2, model, opt, sched)
    for p in model.parameters():  # training goes on: parameters and optimizer state change in place
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    path = write_checkpoint(tmp_path, state)
    restored = trained(0)
    meta = load_checkpoint(path, *restored, CPU)
    assert meta["step"] == 2 and meta["config"] == {"preset": "test"}
    assert_same_training_state(restored, trained(2))


def test_the_optimizers_tensors_are_in_files_of_their_own_and_its_structure_is_small(tmp_path):
    """optimizer.pt holds the structure only; the tensors are spread over the shard files, which
    safetensors' own reader reads, and load back into the same training state."""
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    live = checkpoint_state(1, model, opt, sched, {"preset": "test"}, CPU)
    (live.weights, live.optim), _ = HostBuffers().copy((live.weights, live.optim), CPU)
    path = write_checkpoint(tmp_path, live)
    shards = [load_file(str(path / name)) for name in SHARDS]
    assert all(shards) and sum(len(s) for s in shards) == 8 * 3  # exp_avg, exp_avg_sq, step per parameter
    assert (path / "optimizer.pt").stat().st_size < 8 * 1024 < 4 * (path / SHARDS[0]).stat().st_size
    restored = (torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4))),)
    restored += (torch.optim.AdamW(restored[0].parameters(), lr=0.1),)
    restored += (torch.optim.lr_scheduler.LambdaLR(restored[1], lambda s: 1.0),)
    load_checkpoint(path, *restored, CPU)
    assert_same_training_state(restored, (model, opt, sched))


def test_host_buffers_are_reused_while_the_state_keeps_its_shapes():
    buffers = HostBuffers()
    model, opt, sched = trained(1)
    first, allocated = buffers.copy(model.state_dict(), CPU)
    assert allocated and buffers.nbytes == (6 + 2) * 4
    # One arena, but a storage of its own per tensor: torch.save writes whole storages.
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in first.values())
    with torch.no_grad():
        model.weight.add_(1)
    second, allocated = buffers.copy(model.state_dict(), CPU)
    assert not allocated
    assert [t.data_ptr() for t in first.values()] == [t.data_ptr() for t in second.values()]
    assert torch.equal(second["weight"], model.weight.detach())  # the same memory, the new values
    _, allocated = buffers.copy(torch.nn.Linear(3, 4).state_dict(), CPU)
    assert allocated  # other shapes: new buffers


def test_buffers_reserved_ahead_take_the_first_checkpoint_with_no_allocation_of_its_own(tmp_path):
    logs = []
    writer = CheckpointWriter(tmp_path, 2, logs.append)
    model, opt, sched = trained(1)
    writer.reserve(model, opt, sched, {"preset": "test"}, CPU)  # as after the first step (pageable: at once)
    writer.reserve(model, opt, sched, {"preset": "test"}, CPU)  # once: a later call is a no-op
    writer.save(1, model, opt, sched, {"preset": "test"}, CPU)  # copies into the reserved buffers
    writer.wait()
    assert logs[0].startswith("checkpoint step 1: training blocked ") and "new host buffers" not in logs[0]
    assert_same_training_state(load_after(tmp_path), (model, opt, sched))


def held_allocation(writer, wait_on):
    """Stand in for the writer's background allocation of pinned buffers (CUDA only) with a thread
    that runs until `wait_on` returns; what it returned is appended to the list returned."""
    returned = []
    writer.reserving = threading.Thread(target=lambda: returned.append(wait_on()))
    writer.reserving.start()
    return returned


def test_a_periodic_checkpoint_is_put_off_while_its_buffers_are_allocated_and_a_final_one_is_not(tmp_path):
    """At 8B the pinned buffers take ~7 s after the first step (or a resume's start): a periodic
    checkpoint falling then is taken at the first sync point after, instead of blocking training."""
    logs, release = [], threading.Event()
    writer = CheckpointWriter(tmp_path, 2, logs.append)
    held_allocation(writer, release.wait)
    assert not writer.due(10, scheduled=False, final=False)  # nothing scheduled, nothing owed
    assert not writer.due(20, scheduled=True, final=False)
    assert not writer.due(30, scheduled=False, final=False)  # still owed, still allocating
    assert logs == [
        "checkpoint step 20: put off to the next sync point (its host buffers are still being allocated "
        "in the background; training goes on)"
    ]
    assert writer.due(30, scheduled=True, final=True)  # a stop's, or the last step's: at once
    assert not writer.due(40, scheduled=False, final=False)  # the final one paid what was owed
    assert not writer.due(50, scheduled=True, final=False)
    release.set()
    writer.reserving.join()
    assert writer.due(60, scheduled=False, final=False)  # step 50's, owed, once the buffers are there
    assert not writer.due(70, scheduled=False, final=False)
    assert writer.due(80, scheduled=True, final=False)
    assert len(logs) == 2


def test_a_save_that_waits_for_the_allocation_lifts_its_pauses(tmp_path):
    """A checkpoint that must wait for the background allocation (a stop's, the last step's): the
    remaining arenas go without the pauses that leave room for training's launches (the step loop
    waits anyway)."""
    writer = CheckpointWriter(tmp_path, 2, [].append)
    hurried = held_allocation(writer, lambda: writer.hurry.wait(RESERVE_PAUSE_S * 1200))
    writer.save(1, *trained(1), {"preset": "test"}, CPU)
    writer.wait()
    assert hurried == [True]  # the pause ended because the save asked, not by its timeout
    assert_same_training_state(load_after(tmp_path), trained(1))


def load_after(out_dir):
    """A fresh model, optimizer and scheduler restored from the latest checkpoint in out_dir."""
    restored = trained(0)
    load_checkpoint(latest_checkpoint(out_dir), *restored, CPU)
    return restored


def test_a_crash_in_the_middle_of_a_write_leaves_no_checkpoint_that_resume_takes(tmp_path):
    write_checkpoint(tmp_path, host_state(1, *trained(1)), keep=1)
    with pytest.raises(InjectedFault, match="writing checkpoint step 2"):
        write_checkpoint(tmp_path, host_state(2, *trained(2)), keep=1, fail=True)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in (root / ".tmp_step_00000002").iterdir()) == [
        "drafter.safetensors",
        *SHARDS,
        "optimizer.pt",
    ]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001"]  # not pruned: step 2 never landed
    assert latest_checkpoint(tmp_path) == root / "step_00000001"


def fsyncs_of(monkeypatch, root: Path) -> list[tuple[str, bool]]:
    """A record of each fsync (the real one runs): the path synced, relative to `root`, and whether
    the step-1 checkpoint was published (renamed into place) by then."""
    calls, real = [], os.fsync

    def recording(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append((str(path.relative_to(root)), (root / "checkpoints" / "step_00000001").exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


def wait_for(predicate, what: str, within: float = 60.0) -> None:
    """Wait until predicate() holds; fail naming `what` after `within` seconds (a bound, not a timing)."""
    import time

    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        time.sleep(0.02)


def python_seen_by_flushes(monkeypatch, tmp_path: Path, before_sync: str) -> Path:
    """Point sys.executable, which starts checkpoint_flush.py, at a shell script that runs
    `before_sync` (sh, with $4 the directory synced) before each `--sync` and then execs the real
    interpreter: a look at the flush from outside its process, which runs unchanged."""
    import sys

    script = tmp_path / "python-seen"
    script.write_text(f'#!/bin/sh\nif [ "$3" = "--sync" ]; then {before_sync}\nfi\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    return script


def test_a_durable_write_is_on_the_disk_before_it_is_published(tmp_path, monkeypatch):
    """Every file and the temporary directory are flushed (by checkpoint_flush.py --sync, a process
    of its own) before the rename publishes the checkpoint, and the rename itself after: a power
    loss cannot leave a torn one for --resume."""
    seen = tmp_path / "seen"
    step = tmp_path / "checkpoints" / "step_00000001"
    python_seen_by_flushes(
        monkeypatch, tmp_path, f'{{ [ -e "{step}" ] && echo published || echo unpublished; echo "$@"; }} >> "{seen}"'
    )
    calls = fsyncs_of(monkeypatch, tmp_path)
    write_checkpoint(tmp_path, host_state(1, *trained(1)))
    published, argv = seen.read_text().splitlines()
    tmp = tmp_path / "checkpoints/.tmp_step_00000001"
    files = ["drafter.safetensors", "optimizer.pt", *SHARDS, "meta.json"]
    assert published == "unpublished"
    flushed = argv.split()[3:]  # after `-I SCRIPT --sync`
    assert sorted(flushed) == sorted([str(tmp), *(str(tmp / name) for name in files)])
    assert calls == [("checkpoints", True)]  # here: the rename, once published
    assert_same_training_state(load_after(tmp_path), trained(1))


def test_the_flush_leaves_the_page_cache_once_on_the_disk(tmp_path, monkeypatch):
    """checkpoint_flush.py --sync drops each file from the page cache after its fsync, then flushes
    the directory (the real calls run): the stop's write, which the stop waits for, then need not
    reclaim that memory."""
    from dflash_train.checkpoint_flush import sync_files

    calls, sync, advise = [], os.fsync, os.posix_fadvise

    def name(fd):
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name

    def syncing(fd):
        calls.append(("fsync", name(fd)))
        sync(fd)

    def advising(fd, offset, length, advice):
        calls.append(("dontneed" if advice == os.POSIX_FADV_DONTNEED else advice, name(fd)))
        advise(fd, offset, length, advice)

    files = [tmp_path / f"f{k}" for k in range(3)]
    for path in files:
        path.write_bytes(b"x" * 4096)
    monkeypatch.setattr(os, "fsync", syncing)
    monkeypatch.setattr(os, "posix_fadvise", advising)
    sync_files(tmp_path, files)
    for path in files:
        assert [op for op, of in calls if of == path.name] == ["fsync", "dontneed"]
    assert calls[-1] == ("fsync", tmp_path.name)


def test_a_flush_that_fails_fails_the_write_and_publishes_nothing(tmp_path, monkeypatch):
    """The flush's process cannot open a file (here: a dangling link takes a file's place): its one
    line becomes the write's error, and the checkpoint is not published."""
    python_seen_by_flushes(monkeypatch, tmp_path, 'rm -f "$4/meta.json" && ln -s /nonexistent/meta "$4/meta.json"')
    with pytest.raises(OSError, match="flushing .*meta.json failed"):
        write_checkpoint(tmp_path, host_state(1, *trained(1)))
    assert latest_checkpoint(tmp_path) is None


def test_a_stops_write_does_not_wait_for_the_disk(tmp_path, monkeypatch):
    """durable=False (a stop's checkpoint: the process exits sooner; the writer leaves the flush and
    the removal of older checkpoints to a process of its own, tests/payload/test_train.py): no fsync
    here, the same files, and the checkpoint before it is still there."""
    write_checkpoint(tmp_path, host_state(1, *trained(1)), keep=1)
    seen = tmp_path / "seen"
    python_seen_by_flushes(monkeypatch, tmp_path, f'echo "$4" >> "{seen}"')
    calls = fsyncs_of(monkeypatch, tmp_path)
    write_checkpoint(tmp_path, host_state(2, *trained(2)), keep=1, durable=False)
    assert calls == [] and not seen.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]
    assert_same_training_state(load_after(tmp_path), trained(2))


def test_a_failed_background_write_is_raised_where_the_run_waits(tmp_path):
    logs = []
    writer = CheckpointWriter(tmp_path, 2, logs.append, fail_step=2)
    writer.save(1, *trained(1), {"preset": "test"}, CPU)
    writer.save(2, *trained(2), {"preset": "test"}, CPU)  # waits for step 1's write first
    with pytest.raises(CheckpointWriteError, match="writing the checkpoint of step 2 failed .*InjectedFault"):
        writer.wait()
    writer.wait()  # reported once: nothing in flight any more
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert logs[0].startswith("checkpoint step 1: training blocked ") and " into new host buffers" in logs[0]
    assert logs[1].startswith(f"checkpoint: {tmp_path / 'checkpoints' / 'step_00000001'} (written in ")
    assert logs[2].startswith("checkpoint step 2: training blocked ") and "new host buffers" not in logs[2]
    assert len(logs) == 3


def test_a_stops_checkpoint_waits_for_the_files_of_a_write_in_flight_not_for_their_flush(tmp_path, monkeypatch):
    """A stop during a periodic checkpoint's flush (5-9 s at 8B): the stop's copy goes ahead once that
    write's files are written, the stop's checkpoint is published, the superseded one never is, and
    its temporary directory goes with the flush of the stop's (checkpoint_flush.py, a process of
    its own). Step 1's flush (a process of its own) is held until the stop's checkpoint is out: were
    the stop to wait for it, this test would wait the hold's 60 s out and then fail on the logs."""
    flushing, release = tmp_path / "flushing", tmp_path / "release"
    hold = (
        f'case "$4" in *.tmp_step_00000001) touch "{flushing}"; n=0; '
        f'while [ ! -e "{release}" ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done;; esac'
    )
    python_seen_by_flushes(monkeypatch, tmp_path, hold)
    logs = []
    writer = CheckpointWriter(tmp_path, 2, logs.append)
    writer.save(1, *trained(1), {"preset": "test"}, CPU)  # periodic: flushed before it is published
    wait_for(flushing.exists, "step 1's flush to start")
    writer.save(2, *trained(2), {"preset": "test"}, CPU, durable=False)  # the stop's
    writer.wait()
    release.touch()
    ((superseded, thread),) = writer.superseded
    thread.join()
    pid = int(re.search(r"by pid (\d+)", logs[-1]).group(1))
    os.waitpid(pid, 0)  # the flusher: step 2 on the disk, then step 1's temporary directory removed
    assert superseded.path is None
    assert logs[1] == (
        "checkpoint step 1: its files are written, their flush to the disk is still under way; "
        "the stop's checkpoint replaces it (it is not published)"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    assert_same_training_state(load_after(tmp_path), trained(2))


def test_a_stops_checkpoint_reports_a_write_in_flight_that_failed(tmp_path):
    writer = CheckpointWriter(tmp_path, 2, [].append, fail_step=1)
    writer.save(1, *trained(1), {"preset": "test"}, CPU)
    with pytest.raises(CheckpointWriteError, match="writing the checkpoint of step 1 failed .*InjectedFault"):
        writer.save(2, *trained(2), {"preset": "test"}, CPU, durable=False)
    assert writer.superseded == []


def test_a_checkpoint_written_before_issue_31_still_loads(tmp_path):
    """golden/old_checkpoint: written by the synchronous save_checkpoint of commit d81cff4 (CRC32
    computed, weights copied with .cpu()) from `trained(1)`, config {"preset": "old-format"}."""
    shutil.copytree(OLD, tmp_path, dirs_exist_ok=True)
    path = latest_checkpoint(tmp_path)
    assert path.name == "step_00000001"
    restored = trained(0)
    meta = load_checkpoint(path, *restored, CPU)
    assert meta["step"] == 1 and meta["config"] == {"preset": "old-format"}
    assert_same_training_state(restored, trained(1))


def test_tensors_are_packed_into_arenas_and_a_larger_one_gets_its_own(monkeypatch):
    from dflash_train import host_copy

    monkeypatch.setattr(host_copy, "ARENA_BYTES", 256)
    f32 = torch.float32
    (big, small, other, last), pinned = host_copy._allocate(
        [(torch.Size([100]), f32), (torch.Size([10]), f32), (torch.Size([30]), f32), (torch.Size([40]), f32)],
        pin=False,
    )
    # 400 bytes fill an arena of their own; the next 40 start a 256-byte arena, the 120 after them
    # follow aligned to 64, and the 160 after those no longer fit there.
    assert other.data_ptr() - small.data_ptr() == 64
    assert last.data_ptr() - small.data_ptr() not in range(0, 256)
    assert pinned == [] and [t.nbytes for t in (big, small, other, last)] == [400, 40, 120, 160]
