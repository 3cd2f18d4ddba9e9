"""Flush a stop's checkpoint to the disk after the trainer has exited, then remove the checkpoints it
replaces: `python checkpoint_flush.py CHECKPOINT [OLD ...]`, started by the trainer in a session of
its own (checkpoint.flush_later). Standard library only, run by path: it starts in milliseconds.

A stop waits only for its checkpoint's files to be written into the page cache. Flushing them
(12.6 GB at 8B) and removing the older checkpoints (on an H200 box's ext4, 4.0 s for one 12.6 GB
checkpoint) happen here; the older ones go only once the new one is on the disk, so that a power
loss in between still leaves a checkpoint on disk for --resume.

`python checkpoint_flush.py --sync DIR FILE...` flushes a periodic checkpoint's files (one thread
each) and then DIR, before the trainer publishes it (checkpoint.sync_in_child): a process of its own
so that a stop, which supersedes that write, exits without waiting for `fsync` calls under way
(the kernel lets a process end only once its threads' system calls return). Exit 0, or 1 with one
line on stderr."""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a written file or a directory's entries to the disk (fsync acts on the inode, so a new
    descriptor flushes what another one wrote). Filesystems that cannot sync a directory say EINVAL:
    its entries are then as durable as that filesystem makes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (path.is_dir() and exc.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache once it is on the disk (POSIX_FADV_DONTNEED frees
    clean pages at once): only --resume reads a checkpoint again, and 12.6 GB of cached pages per
    8B checkpoint leave the next write (a stop's, which the stop waits for) to reclaim memory
    first (an H200 box: a stop's write after two flushed checkpoints 7.7 s, 5.0 s with them
    evicted, docs/performance.md runs 20-21). Where the call is missing or refused, the pages stay
    cached."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def flush_and_prune(checkpoint: Path, old: list[Path]) -> None:
    """Flush the checkpoint's files, itself and its parent directory, then remove `old`."""
    for path in [*sorted(checkpoint.iterdir()), checkpoint, checkpoint.parent]:
        fsync_path(path)
    for path in old:
        shutil.rmtree(path, ignore_errors=True)


def sync_files(directory: Path, files: list[Path]) -> None:
    """Flush the files at once (one thread each) and drop them from the page cache, then the directory."""
    from concurrent.futures import ThreadPoolExecutor

    def flushed(path: Path) -> None:
        fsync_path(path)
        evict(path)

    with ThreadPoolExecutor(max(1, len(files))) as pool:
        for done in [pool.submit(flushed, path) for path in files]:
            done.result()
    fsync_path(directory)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sync"]:
        try:
            sync_files(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
        except OSError as exc:
            sys.stderr.write(f"flushing {exc.filename or sys.argv[2]} failed: {exc.strerror or exc}\n")
            sys.exit(1)
    else:
        flush_and_prune(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
