"""Remote side of `dflashctl push`: list the live payload, stage a new version, swap it in.

Runs inside the container as `python -S -c <this source> sync WORKDIR`, so it may use only
the standard library and must stay compatible with old Python 3 (no walrus, no 3.8+ APIs).
The client imports the same file for `manifest_hash` and `hash_file`, so both sides agree.

Layout under WORKDIR (documented in docs/push.md):
  payload                       symlink -> .payload/v/<vid>   (the only name users see)
  .payload/v/<vid>/             one complete version of the payload
  .payload/m/<vid>.json         its manifest: path, size, sha256, mode (+ a stat cache)
  .payload/stage-<vid>/         a version being built; renamed into v/ when complete
  .payload/link-<vid>           the new symlink, renamed over `payload` in one rename(2)
  .payload/lock                 flock held while a push changes anything
Each version is complete on its own; unchanged files are hard links to the previous version.
"""

import errno
import fcntl
import hashlib
import json
import os
import queue
import stat
import sys
import threading
import time

FORMAT = 1
CHUNK = 1024 * 1024
LOCK_WAIT_S = 30.0

# Exit codes the client maps to error types (see dflashctl/payload.py).
EXIT_PROTOCOL = 2
EXIT_NOSPACE = 3
EXIT_DENIED = 4
EXIT_BUSY = 5
EXIT_VERIFY = 7
EXIT_OS = 8


class Failure(Exception):
    """An error with a one-line message and an exit code for the client."""

    def __init__(self, message, code):
        Exception.__init__(self, message)
        self.code = code


def hash_file(path):
    """(sha256 hex, size) of a file's content."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while True:
            block = handle.read(CHUNK)
            if not block:
                break
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def manifest_hash(entries):
    """Stable sha256 over (mode, size, sha256, path) of every entry, in path order."""
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e["p"].encode("utf-8", "surrogateescape")):
        # json.dumps quotes the path, so names with spaces or newlines cannot run together.
        line = "%o %d %s %s\n" % (entry["m"], entry["s"], entry["h"], json.dumps(entry["p"]))
        digest.update(line.encode("ascii"))
    return digest.hexdigest()


class Layout(object):
    """Paths of one workdir's payload store."""

    def __init__(self, workdir):
        self.workdir = os.path.abspath(os.path.expanduser(workdir))
        self.link = os.path.join(self.workdir, "payload")
        self.store = os.path.join(self.workdir, ".payload")
        self.versions = os.path.join(self.store, "v")
        self.manifests = os.path.join(self.store, "m")

    def version_dir(self, vid):
        """Directory holding version vid's files."""
        return os.path.join(self.versions, vid)

    def manifest_path(self, vid):
        """Where version vid's manifest is stored."""
        return os.path.join(self.manifests, vid + ".json")

    def link_target(self, vid):
        """What the `payload` link points at for version vid."""
        # Relative, so the link also resolves from the host side of a container's filesystem.
        return os.path.join(".payload", "v", vid)

    def current(self):
        """The live version id, or None when there is no managed payload yet."""
        try:
            target = os.readlink(self.link)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINVAL):  # EINVAL: a plain directory
                return None
            raise
        parts = target.split(os.sep)
        if len(parts) != 3 or parts[:2] != [".payload", "v"]:
            return None
        return parts[2]


def read_manifest(layout, vid):
    """The stored manifest of a version, or None if it is missing or unreadable."""
    if vid is None:
        return None
    try:
        with open(layout.manifest_path(vid), "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT or data.get("vid") != vid:
        return None
    return data


def fs_path(root, rel):
    """Absolute path of a manifest path under root, refusing anything that escapes root."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise Failure("refusing unsafe path in manifest: %r" % rel, EXIT_PROTOCOL)
    return os.path.join(root, *parts)


def stat_key(st):
    """(inode, mtime_ns): while a file's key matches the manifest's, its stored hash still holds."""
    return [st.st_ino, st.st_mtime_ns]


def verified_entries(layout, manifest):
    """The live files' real (path, size, sha256, mode); rehash only where the stat cache is stale."""
    root = layout.version_dir(manifest["vid"])
    out = []
    for entry in manifest["files"]:
        path = fs_path(root, entry["p"])
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone: the client will send it again
        if not stat.S_ISREG(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_size == entry["s"] and stat_key(st) == entry.get("k"):
            sha, size = entry["h"], entry["s"]
        else:
            sha, size = hash_file(path)
        out.append({"p": entry["p"], "s": size, "h": sha, "m": mode, "k": stat_key(st)})
    return out


def lock(layout):
    """Hold the store's flock (waiting up to LOCK_WAIT_S) so two pushes never interleave."""
    make_dirs(layout.store)
    handle = open(os.path.join(layout.store, "lock"), "a+b")
    deadline = time.time() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.time() > deadline:
                handle.close()
                raise Failure("another push to %s is still running" % layout.workdir, EXIT_BUSY)
            time.sleep(0.1)


def make_dirs(path):
    """Create path and its parents unless it is already a directory."""
    if not os.path.isdir(path):
        os.makedirs(path)


def remove(path):
    """Delete a file, link or tree; missing is fine."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        import shutil  # imported here: most pushes never need it, and startup is paid on every push

        shutil.rmtree(path)


def clean(layout, keep):
    """Remove staging leftovers, stray links, and versions neither in keep nor in use."""
    keep = keep | versions_in_use(layout)
    if os.path.isdir(layout.store):
        for name in os.listdir(layout.store):
            if name.startswith("stage-") or name.startswith("link-"):
                remove(os.path.join(layout.store, name))
    if os.path.isdir(layout.versions):
        for name in os.listdir(layout.versions):
            if name not in keep:
                remove(layout.version_dir(name))
    if os.path.isdir(layout.manifests):
        for name in os.listdir(layout.manifests):
            if name.split(".")[0] not in keep:  # <vid>.json, or <vid>.json.tmp from a killed push
                remove(os.path.join(layout.manifests, name))


def versions_in_use(layout):
    """Versions that a live process has as its cwd: a trainer started before older pushes keeps its files."""
    prefix = os.path.realpath(layout.versions) + os.sep
    used = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return used  # no /proc: only the live and the previous version are kept
    for pid in pids:
        try:
            cwd = os.readlink("/proc/%s/cwd" % pid)
        except OSError:
            continue  # gone, or another user's process
        if cwd.startswith(prefix):
            used.add(cwd[len(prefix) :].split(os.sep)[0])
    return used


def free_bytes(path):
    """Free space for unprivileged writes on the filesystem holding path (or its nearest parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def cmd_sync(workdir, dry_run):
    """Print the live payload's verified manifest, then apply the client's changes from stdin.

    One process does both halves under one lock, so a push is a single remote command and
    nothing can change the live payload between the listing and the swap.
    """
    layout = Layout(workdir)
    handle = None if dry_run else lock(layout)
    try:
        base = read_manifest(layout, layout.current())
        if handle is not None:
            clean(layout, keep_set(base))  # leftovers of pushes killed at any point
        live = verified_entries(layout, base) if base else []
        write_line(
            {
                "format": FORMAT,
                "vid": base["vid"] if base else None,
                "remote_dir": layout.link,
                "free": free_bytes(layout.workdir),
                "files": [dict((k, e[k]) for k in "pshm") for e in live],
            }
        )
        if dry_run:
            return
        stream = Stream(sys.stdin.buffer)
        first = stream.raw.readline()
        if not first:
            return  # the client had nothing to change (or went away): the live payload stays
        if not first.endswith(b"\n"):
            raise Failure("push stream ended early (client gone)", EXIT_PROTOCOL)
        header = json.loads(first.decode("utf-8"))
        if header.get("format") != FORMAT:
            raise Failure("client and remote script disagree on the stream format", EXIT_PROTOCOL)
        vid = header["vid"]
        if not vid or not all(c.isalnum() or c == "-" for c in vid):
            raise Failure("bad version id from the client: %r" % vid, EXIT_PROTOCOL)
        stage = os.path.join(layout.store, "stage-" + vid)
        try:
            entries = build(layout, stage, base, live, header["files"], stream)
            finish(layout, stage, vid, base["vid"] if base else None, entries, header["hash"])
        except BaseException:
            remove(stage)  # best effort; the next push's clean() catches what this misses
            raise
        clean(layout, keep_set(read_manifest(layout, vid)))
        write_line({"vid": vid, "hash": header["hash"], "remote_dir": layout.link})
    finally:
        if handle is not None:
            handle.close()


def keep_set(manifest):
    """Versions a cleanup must keep: the live one and the one it replaced (a run may still use it)."""
    if not manifest:
        return set()
    return set(v for v in (manifest["vid"], manifest.get("previous")) if v)


class Stream(object):
    """Reads the apply stream from stdin; a short read means the client went away."""

    def __init__(self, raw):
        self.raw = raw

    def chunks(self, size):
        """Exactly size bytes, in pieces of at most CHUNK."""
        left = size
        while left:
            data = self.raw.read(min(left, CHUNK))
            if not data:
                raise Failure("push stream ended early (client gone)", EXIT_PROTOCOL)
            left -= len(data)
            yield data


class Writer(threading.Thread):
    """Writes received files on a second thread, so disk work overlaps reading and hashing the stream.

    File creation dominates a first push of many small files; both threads spend that time in
    system calls, which release the GIL.
    """

    def __init__(self):
        threading.Thread.__init__(self)
        self.daemon = True
        self.jobs = queue.Queue(maxsize=16)
        self.error = None

    def run(self):
        """Apply queued op lists until the None sentinel; after an error, keep draining without writing."""
        fd = None
        while True:
            ops = self.jobs.get()
            if ops is None:
                break
            if self.error is not None:
                continue  # keep draining so the reader never blocks on a full queue
            try:
                for op in ops:
                    fd = self.do(fd, op)
            except OSError as exc:
                self.error = exc
        if fd is not None:
            os.close(fd)

    def do(self, fd, op):
        """Apply one op (open, data or close) and return the file descriptor now open, if any."""
        kind, arg = op
        if kind == "open":
            path, mode = arg
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.fchmod(fd, mode)  # exact bits, whatever the umask
            return fd
        if kind == "data":
            view = memoryview(arg)
            while view:
                view = view[os.write(fd, view) :]
            return fd
        os.close(fd)
        return None

    def finish(self):
        """Wait for every queued write; raise the first write error."""
        self.jobs.put(None)
        self.join()
        if self.error is not None:
            raise self.error


def build(layout, stage, base, live, files, stream):
    """Fill stage with every file: hard links to the base version, or bytes from the stream."""
    base_root = layout.version_dir(base["vid"]) if base else None
    verified = dict((e["p"], e) for e in live)
    entries = []
    made = set()
    os.makedirs(stage)
    writer = Writer()
    writer.start()
    try:
        receive_all(stage, base_root, verified, files, stream, writer, made, entries)
    finally:
        writer.finish()
    if stream.raw.read(1):
        raise Failure("push stream has trailing data", EXIT_PROTOCOL)
    return entries


def receive_all(stage, base_root, verified, files, stream, writer, made, entries):
    """Carry or receive each file of the header, in order, appending its verified entry."""
    for entry in files:
        if writer.error is not None:
            raise writer.error  # e.g. disk full: stop reading the rest of the stream
        path = fs_path(stage, entry["p"])
        parent = os.path.dirname(path)
        if parent not in made:
            make_dirs(parent)
            made.add(parent)
        if entry["src"] == "base":
            if entry["p"] not in verified:
                raise Failure("client asked to keep %s, which the live payload lacks" % entry["p"], EXIT_PROTOCOL)
            sha, size = carry(fs_path(base_root, entry["p"]), path, verified[entry["p"]])
        else:
            sha, size = receive(stream, writer, path, entry)
        if (sha, size) != (entry["h"], entry["s"]):
            raise Failure("verification failed for %s: content differs from the local file" % entry["p"], EXIT_VERIFY)
        entries.append({"p": entry["p"], "s": size, "h": sha, "m": entry["m"]})


def carry(src, dst, live):
    """Bring an unchanged file over without resending it: a hard link, or a copy where links fail."""
    try:
        os.link(src, dst)  # same inode, so same mode: the client sends files whose mode changed
    except OSError:
        import shutil

        shutil.copyfile(src, dst)
        os.chmod(dst, live["m"])
    st = os.lstat(dst)
    if stat_key(st) == live["k"] and st.st_size == live["s"]:
        return live["h"], live["s"]  # the very inode hashed (or stat-verified) moments ago
    return hash_file(dst)


def receive(stream, writer, path, entry):
    """Hash a sent file's bytes as they arrive and queue them for the writer thread."""
    digest = hashlib.sha256()
    ops = [("open", (path, entry["m"]))]
    left = entry["s"]
    for data in stream.chunks(entry["s"]):
        digest.update(data)
        left -= len(data)
        ops.append(("data", data))
        if left:  # the last chunk travels with the close: one hand-off per small file
            writer.jobs.put(ops)
            ops = []
    ops.append(("close", None))
    writer.jobs.put(ops)
    return digest.hexdigest(), entry["s"]


def finish(layout, stage, vid, base_vid, entries, expected_hash):
    """Check the staged manifest, publish the version, and swap the link in one rename."""
    got = manifest_hash(entries)
    if got != expected_hash:
        raise Failure(
            "verification failed: staged manifest %s != local %s" % (got[:12], expected_hash[:12]), EXIT_VERIFY
        )
    make_dirs(layout.versions)
    make_dirs(layout.manifests)
    final = layout.version_dir(vid)
    for entry in entries:
        st = os.lstat(fs_path(stage, entry["p"]))
        entry["k"] = stat_key(st)  # rename keeps inodes and mtimes, so the cache stays valid
    manifest = {"format": FORMAT, "vid": vid, "previous": base_vid, "hash": got, "files": entries}
    write_file(layout.manifest_path(vid), json.dumps(manifest).encode("utf-8"))
    os.rename(stage, final)
    swap_link(layout, vid)
    if layout.current() != vid:
        raise Failure("verification failed: %s does not point at the new version" % layout.link, EXIT_VERIFY)


def swap_link(layout, vid):
    """Point `payload` at the new version with rename(2), which replaces the old link atomically."""
    tmp = os.path.join(layout.store, "link-" + vid)
    remove(tmp)
    # The link lives in .payload/ until the rename, so its target is written relative to workdir.
    os.symlink(layout.link_target(vid), tmp)
    if os.path.isdir(layout.link) and not os.path.islink(layout.link):
        # A plain directory from another tool: move it aside once (the one non-atomic step).
        os.rename(layout.link, os.path.join(layout.versions, "plain-" + vid))
    os.rename(tmp, layout.link)


def write_file(path, data):
    """Write data to path via a temporary file and a rename, so no reader sees a partial file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.rename(tmp, path)


def write_line(obj):
    """Send obj to the client as one JSON line on stdout, flushed at once."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def describe_os_error(exc):
    """(message, exit code) for an OSError, naming the path involved."""
    where = exc.filename or ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device writing %s" % where, EXIT_NOSPACE
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission denied: %s" % where, EXIT_DENIED
    return "%s: %s" % (exc.strerror or exc, where), EXIT_OS


def main(argv):
    """Entry point: `sync WORKDIR [--dry-run]`; errors are one stderr line and an exit code."""
    try:
        if len(argv) in (2, 3) and argv[0] == "sync" and argv[2:] in ([], ["--dry-run"]):
            cmd_sync(argv[1], dry_run=len(argv) == 3)
        else:
            raise Failure("usage: payload_sync sync WORKDIR [--dry-run]", EXIT_PROTOCOL)
    except Failure as exc:
        sys.stderr.write("payload_sync: %s\n" % exc)
        return exc.code
    except OSError as exc:
        message, code = describe_os_error(exc)
        sys.stderr.write("payload_sync: %s\n" % message)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
