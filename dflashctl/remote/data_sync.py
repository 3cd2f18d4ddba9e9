"""Remote side of `dflashctl data`: datasets in `<workdir>/data/`, stdlib only.

    python -c <this source> list WORKDIR             -> {"datasets": [{name, size, rows, sha256}]}
    python -c <this source> put WORKDIR NAME SIZE SHA256 < bytes   -> {"name", "size", "rows", "sha256"}

`put` streams stdin into a hidden partial file in the same directory while hashing and counting
lines, checks the size and hash it was told, fsyncs, then renames it over NAME: a transfer that
stops early leaves the old copy (or none) and nothing under the final name. `data/.index.json`
records each dataset's size, rows and hash, so an unchanged file is known without reading it;
`list` records a file that came another way (`data regen` writes its output there) the first
time it sees it. Hidden files (partial transfers and regenerations) are never datasets.
"""

import hashlib
import json
import os
import re
import sys

INDEX = ".index.json"
NAME_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,199}$")
CHUNK = 1 << 20


def emit(obj):
    """Print one JSON answer and flush."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def data_dir(workdir):
    """`<workdir>/data`, created if missing."""
    path = os.path.join(os.path.expanduser(workdir), "data")
    os.makedirs(path, exist_ok=True)
    return path


def read_index(root):
    """The recorded datasets {name: {size, rows, sha256}} that still exist with that size."""
    try:
        with open(os.path.join(root, INDEX)) as fh:
            index = json.load(fh)
    except (OSError, ValueError):
        return {}
    alive = {}
    for name, entry in index.items():
        try:
            if os.path.getsize(os.path.join(root, name)) == entry["size"]:
                alive[name] = entry
        except (OSError, KeyError, TypeError):
            pass
    return alive


def write_index(root, index):
    """Replace the index atomically."""
    tmp = os.path.join(root, ".index.json.tmp.%d" % os.getpid())
    with open(tmp, "w") as fh:
        json.dump(index, fh, indent=1)
    os.replace(tmp, os.path.join(root, INDEX))


def describe(path):
    """{size, rows, sha256} of a file, read in chunks."""
    digest, size, rows = hashlib.sha256(), 0, 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
            rows += chunk.count(b"\n")
    return {"size": size, "rows": rows, "sha256": digest.hexdigest()}


def cmd_list(workdir):
    """Every dataset: the recorded ones, and files that came into data/ another way (written by
    `data regen`, copied by hand), hashed once and recorded."""
    import fcntl

    root = data_dir(workdir)
    with open(os.path.join(root, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = read_index(root)
        found = {}
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name not in index and NAME_RE.match(name) and os.path.isfile(path) and not os.path.islink(path):
                found[name] = describe(path)
        if found:
            index.update(found)
            write_index(root, index)
    emit({"datasets": [dict(name=name, **entry) for name, entry in sorted(index.items())]})


def cmd_put(workdir, name, size, sha256):
    """Receive one dataset from stdin (see the module docstring)."""
    import fcntl

    if not NAME_RE.match(name):
        emit({"error": "bad_request", "message": "bad dataset name %r (letters, digits, . _ -)" % name})
        return 2
    root = data_dir(workdir)
    size = int(size)
    partial = os.path.join(root, ".%s.partial.%d" % (name, os.getpid()))
    digest, received, rows = hashlib.sha256(), 0, 0
    with open(partial, "wb") as out:
        while True:
            chunk = (
                sys.stdin.buffer.read1(CHUNK) if hasattr(sys.stdin.buffer, "read1") else sys.stdin.buffer.read(CHUNK)
            )
            if not chunk:
                break
            out.write(chunk)
            digest.update(chunk)
            received += len(chunk)
            rows += chunk.count(b"\n")
        out.flush()
        os.fsync(out.fileno())
    if received != size or digest.hexdigest() != sha256:
        os.remove(partial)
        emit(
            {
                "error": "mismatch",
                "message": "received %d bytes (sha256 %s), expected %d (%s): the old copy is "
                "unchanged" % (received, digest.hexdigest()[:12], size, sha256[:12]),
            }
        )
        return 1
    with open(os.path.join(root, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.replace(partial, os.path.join(root, name))
        index = read_index(root)
        index[name] = {"size": size, "rows": rows, "sha256": sha256}
        write_index(root, index)
    for stale in os.listdir(root):  # partials of transfers that were killed outright
        pid = stale.rsplit(".", 1)[-1]
        if stale.startswith(".%s.partial." % name) and pid.isdigit() and not os.path.exists("/proc/%s" % pid):
            try:
                os.remove(os.path.join(root, stale))
            except OSError:
                pass
    emit(dict(name=name, **index[name]))
    return 0


def main(argv):
    """Dispatch `list` / `put`."""
    if argv[:1] == ["list"] and len(argv) == 2:
        cmd_list(argv[1])
        return 0
    if argv[:1] == ["put"] and len(argv) == 5:
        return cmd_put(*argv[1:])
    sys.stderr.write("usage: data_sync {list WORKDIR | put WORKDIR NAME SIZE SHA256}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
