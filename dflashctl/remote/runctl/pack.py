"""`runctl pack`: a run's files as one JSON header line and a tar stream (`dflashctl runs pull`)."""

import os
import sys

from ..wire import CHECKPOINT_CHOICES
from .common import RunError, emit, runs_root
from .state import checkpoint_key, resolve, state_of


def pack_list(run_dir, checkpoints):
    """(archive name, path, size) of the run's regular files, checkpoints/ as chosen; links skipped."""
    found = []
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    keep = None  # checkpoint entries to include (None: all)
    if checkpoints == "latest":
        entries = (
            sorted((e for e in os.listdir(ckpt_dir) if not e.startswith(".")), key=checkpoint_key)
            if os.path.isdir(ckpt_dir)
            else []
        )
        keep = set(entries[-1:])
    for top, dirs, files in os.walk(run_dir):
        rel_top = os.path.relpath(top, run_dir)
        if rel_top == ".":
            if checkpoints == "none" and "checkpoints" in dirs:
                dirs.remove("checkpoints")
        elif rel_top == "checkpoints":
            dirs[:] = [d for d in dirs if not d.startswith(".") and (keep is None or d in keep)]
            files = [f for f in files if not f.startswith(".") and (keep is None or f in keep)]
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(top, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.normpath(os.path.join(rel_top, name))
            found.append((rel, path, os.path.getsize(path)))
    return found


def cmd_pack(workdir, selector, checkpoints="none"):
    """One JSON header line (run id, state, file count, bytes), then the run's files as a tar on stdout."""
    import tarfile

    if checkpoints not in CHECKPOINT_CHOICES:
        raise RunError("bad_request", "checkpoints must be one of %s" % ", ".join(CHECKPOINT_CHOICES))
    run_id, run_dir, meta = resolve(runs_root(workdir), selector)
    files = pack_list(run_dir, checkpoints)
    emit(
        {
            "run_id": run_id,
            "state": state_of(run_dir, meta)[0],
            "files": len(files),
            "bytes": sum(size for _, _, size in files),
        }
    )
    out = sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, size in files:
            info = tar.gettarinfo(path, arcname=rel)
            info.size = size  # as counted in the header: a log that grew since is cut there
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    out.flush()
