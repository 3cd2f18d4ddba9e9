"""`runctl read`: a run's log (and its latest metrics) streamed as frames (wire.FRAME_*) until the
run ends; the client resumes from (inode, offset) after a dropped connection."""

import json
import os
import re
import signal
import struct
import time

from ..wire import (
    FRAME_DATA,
    FRAME_END,
    FRAME_HEARTBEAT,
    FRAME_METRICS,
    FRAME_ROTATED,
    FRAME_START,
    LOG,
    META,
    METRICS,
    ROTATED,
)
from .common import SUPERVISED, alive, read_json, runs_root
from .state import last_metrics, resolve, state_of


POLL_S = 0.05  # reader poll period: bounds the added log latency
HEARTBEAT_S = 1.0  # an idle reader writes this often, so it notices a vanished client
STEP_RE = re.compile(rb"\bstep[\s=:\[]*(\d+)", re.I)


def frame(kind, payload=b""):
    """Write one frame to stdout unbuffered (SIGPIPE is default: a vanished client ends us)."""
    if not isinstance(payload, bytes):
        payload = json.dumps(payload).encode()
    view = memoryview(kind + struct.pack(">I", len(payload)) + payload)
    while view:
        view = view[os.write(1, view) :]


def start_offset(path, lines, since_step):
    """Where a tail starts: first line with step >= since_step, else the last `lines` lines (<0: all)."""
    if lines < 0 and since_step is None:
        return 0
    try:
        fh = open(path, "rb")
    except OSError:
        return 0
    with fh:
        if since_step is not None:
            pos = 0
            for line in fh:
                m = STEP_RE.search(line)
                if m and int(m.group(1)) >= since_step:
                    return pos
                pos += len(line)
            return pos
        fh.seek(0, os.SEEK_END)
        end = pos = fh.tell()
        if lines == 0:
            return end
        found = 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
            if pos + step == end and block.endswith(b"\n"):
                block = block[:-1]  # the final newline does not start a line
            for i in range(len(block) - 1, -1, -1):
                if block[i : i + 1] == b"\n":
                    found += 1
                    if found == lines:
                        return pos + i + 1
        return 0


def open_at(run_dir, inode, offset, lines, since_step):
    """Open the log where the client left off (inode + offset), or at the tail's start."""
    for name in (LOG, ROTATED):
        path = os.path.join(run_dir, name)
        try:
            fh = open(path, "rb")
        except OSError:
            continue
        st = os.fstat(fh.fileno())
        if inode is None and name == LOG:
            fh.seek(start_offset(path, lines, since_step))
            return fh, st.st_ino
        if inode is not None and st.st_ino == inode and st.st_size >= offset:
            fh.seek(offset)
            return fh, st.st_ino
        fh.close()
    return None, None


def cmd_read(workdir, selector, inode, offset, lines, since_step, follow, metrics):
    """Stream the log (and, if asked, the latest metrics) as frames until the run ends."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    run_id, run_dir, meta = resolve(runs_root(workdir), selector)
    inode = int(inode) if inode else None
    fh, ino = open_at(run_dir, inode, int(offset or 0), int(lines), int(since_step) if since_step else None)
    if fh is None and inode is not None:
        # The file the client was reading is gone (rotated twice): restart on the current log.
        fh, ino = open_at(run_dir, None, 0, -1, None)
    frame(FRAME_START, {"run_id": run_id, "inode": ino, "offset": fh.tell() if fh else 0})
    stream_log(run_dir, meta, fh, ino, follow == "1", metrics == "1")


def stream_log(run_dir, meta, fh, ino, follow, metrics):
    """The reader loop: send what the log gains, switch files on rotation, end with the run."""
    log_path = os.path.join(run_dir, LOG)
    parent = os.getppid()
    last_write = time.time()
    metrics_size = -1
    while True:
        if fh is None:  # the supervisor has not created the log yet
            try:
                fh = open(log_path, "rb")
                ino = os.fstat(fh.fileno()).st_ino
                frame(FRAME_ROTATED, {"inode": ino})
            except OSError:
                pass
        chunk = fh.read(65536) if fh else b""
        if chunk:
            frame(FRAME_DATA, chunk)
            last_write = time.time()
            continue
        if fh is not None:
            switched = follow_rotation(fh, ino, log_path)
            if switched:
                fh, ino = switched
                continue
        if metrics:
            metrics_size = send_metrics(run_dir, metrics_size)
        if not follow or (state_of(run_dir, meta)[0] not in ("running", "queued") and supervised(run_dir)):
            if fh is not None and fh.read(1):  # the last lines arrived after our read: drain first
                fh.seek(-1, os.SEEK_CUR)
                continue
            state, code = state_of(run_dir, meta)
            frame(FRAME_END, {"state": state, "exit_code": code})
            return
        if time.time() - last_write >= HEARTBEAT_S:
            if os.getppid() != parent:  # whoever started us is gone: nobody is listening
                return
            frame(FRAME_HEARTBEAT)
            last_write = time.time()
        time.sleep(POLL_S)


def supervised(run_dir):
    """True once nothing more will be written to the run's log by its supervisor: it said it is
    done (after the final event hook), or it is gone (killed, or a run from before SUPERVISED)."""
    if os.path.exists(os.path.join(run_dir, SUPERVISED)):
        return True
    return not alive((read_json(os.path.join(run_dir, META)) or {}).get("supervisor"))


def follow_rotation(fh, ino, log_path):
    """After EOF: a new train.log (renamed away) or a truncated one means switch or restart."""
    try:
        st = os.stat(log_path)
    except OSError:
        return None  # renamed, the new one not created yet
    if st.st_ino != ino:
        if fh.read(1):  # finish the old file first
            fh.seek(-1, os.SEEK_CUR)
            return None
        fh.close()
        new = open(log_path, "rb")
        ino = os.fstat(new.fileno()).st_ino
        frame(FRAME_ROTATED, {"inode": ino})
        return new, ino
    if st.st_size < fh.tell():  # truncated in place (copytruncate)
        fh.seek(0)
        frame(FRAME_ROTATED, {"inode": ino})
        return fh, ino
    return None


def send_metrics(run_dir, known_size):
    """Send the latest metrics when metrics.jsonl changed; returns its size now."""
    path = os.path.join(run_dir, METRICS)
    try:
        size = os.stat(path).st_size
    except OSError:
        return known_size
    if size != known_size:
        record = last_metrics(run_dir)
        if record:
            frame(FRAME_METRICS, record)
    return size
