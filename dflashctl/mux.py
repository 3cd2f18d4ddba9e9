"""Connection reuse across CLI calls (hosts.yaml `persist: SECONDS`), like OpenSSH's ControlPersist.

The first CLI call that needs a host with `persist > 0` starts a detached background *mux*
(`python -m dflashctl.mux_server`) that holds one paramiko connection, made by the same `SshTransport`
code as a direct call (same host-key checks, ~/.ssh/config, keys), and serves commands over a unix
socket. Later calls talk to the socket and never import paramiko, connect or authenticate.

Client side (this module, which imports no paramiko): `MuxTransport`, `stop_mux`, `mux_stats`.
Server side: mux_server.py (imports `.ssh` lazily).

Socket directory: `$XDG_RUNTIME_DIR/dflashctl`, else `~/.cache/dflashctl/mux`; mode 0700, owned by
us, else refused (and the call goes direct). Socket name: a hash of the host's name,
user@host:port, the SSH settings, persist and $HOME (one mux per hosts.yaml entry). The mux checks SO_PEERCRED on
every accept (only our uid is served), and the
client checks the socket file's owner and mode and the mux's uid. Nothing secret is written: the
socket carries argv, env and the streams; keys stay in the mux's memory as in a direct call.

Protocol: one unix connection per command. Frames are `type (1 byte) | length (4 bytes, big
endian) | payload`. Client -> mux: START (JSON {argv, env}), STDIN, EOF, KILL, STATS, EXIT.
Mux -> client: STARTED, STDOUT, STDERR, CODE (4-byte signed exit code), ERROR (JSON {cls, msg}),
GONE (the mux is shutting down and ran nothing: try a fresh one), INFO (JSON answer to STATS/EXIT).

Lifetime: the mux exits after `persist` seconds with no open command and no new client, when
its SSH connection dies, on SIGTERM, or on `dflashctl hosts disconnect`. A socket whose mux is
gone (connect refused) is replaced by the next mux, which holds a flock on `<hash>.lock` for
its whole life so that two muxes never serve one socket.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import errors as _errors
from .errors import ConnectionLost, DflashError, UsageError
from .inventory import HostSpec
from .transport import Process, Read1Stream, Transport

if TYPE_CHECKING:
    from .ssh import SshOptions

log = logging.getLogger("dflashctl.mux")

START, STDIN, EOF, KILL, STATS, EXIT = b"S", b"I", b"E", b"K", b"Q", b"X"
STARTED, STDOUT, STDERR, CODE, ERROR, GONE, INFO = b"R", b"O", b"e", b"C", b"F", b"G", b"N"
_HEADER = struct.Struct("!cI")
_PEERCRED = struct.Struct("3i")
SPAWN_WAIT_S = 15.0  # how long a client waits for a new mux's socket (its paramiko import, not SSH)
LOCK_WAIT_S = 5.0  # how long a new mux waits for a dying one to let go of the lock


class MuxUnavailable(Exception):
    """The mux cannot be used (unsafe dir, cannot start, protocol trouble): go direct."""


# --- paths ----------------------------------------------------------------------------------------


def mux_dir(create: bool = True) -> Path:
    """The private socket directory, created 0700; MuxUnavailable when it is not ours alone."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = Path(runtime) / "dflashctl"
    else:
        path = Path.home() / ".cache" / "dflashctl" / "mux"
    if create:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise MuxUnavailable(f"cannot create {path}: {exc}") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise MuxUnavailable(f"{path}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise MuxUnavailable(
            f"refusing mux directory {path}: must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )
    return path


def _options_dict(options: "SshOptions | None") -> dict:
    if options is None:
        return {}
    data = asdict(options)
    data["home"] = str(data["home"]) if data["home"] is not None else None
    return data


def mux_key(host: HostSpec, options: "SshOptions | None") -> str:
    """A name for host's mux: hash of the inventory file and name, user@address:port, the SSH settings,
    persist, the options and $HOME (one mux per hosts.yaml entry, so messages name the right host and file)."""
    ident = {
        "name": host.name,
        "persist": host.persist,
        "target": f"{host.user or ''}@{host.address or host.name}:{host.port or ''}",
        "identity_file": host.identity_file,
        "inventory_file": host.inventory_file,
        "proxy_jump": host.proxy_jump,
        "options": _options_dict(options),
        "home": os.environ.get("HOME", ""),
        "uid": os.getuid(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def socket_path(host: HostSpec, options: "SshOptions | None", create: bool = True) -> Path:
    """Where host's mux listens (MuxUnavailable when the directory is unsafe or the path too long)."""
    path = mux_dir(create) / f"{mux_key(host, options)}.sock"
    if len(os.fsencode(path)) >= 104:  # sun_path limit (108 on Linux, 104 elsewhere)
        raise MuxUnavailable(f"socket path too long: {path}")
    return path


# --- framing --------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    head = _HEADER.pack(kind, len(payload))
    if len(payload) < 65536:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf.extend(part)
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes] | None:
    """One frame, or None at end of stream."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    kind, length = _HEADER.unpack(head)
    payload = _recv_exact(sock, length) if length else b""
    if payload is None:
        return None
    return kind, payload


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


# --- client ---------------------------------------------------------------------------------------


def connect(path: Path) -> socket.socket:
    """A connection to the mux at path after checking the socket file and the peer's uid.

    Raises FileNotFoundError/ConnectionRefusedError when no mux listens there, MuxUnavailable
    when the socket is not ours.
    """
    st = os.lstat(path)  # FileNotFoundError: no mux yet
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise MuxUnavailable(f"refusing socket {path}: not a socket of uid {os.getuid()} with mode 0600")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise MuxUnavailable(f"{path}: served by another user")
    except BaseException:
        sock.close()
        raise
    return sock


def _spawn(host: HostSpec, options: "SshOptions | None", path: Path) -> None:
    """Start a detached mux for host (it double-forks; we only wait for the first fork)."""
    config = json.dumps(
        {"host": _host_dict(host), "options": _options_dict(options) if options else None, "path": str(path)}
    )
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflashctl.mux_server", config],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
            cwd="/",
            env=env,
        )
        proc.wait(10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise MuxUnavailable(f"cannot start the mux: {exc}") from None


def _host_dict(host: HostSpec) -> dict:
    return {
        "name": host.name, "address": host.address, "user": host.user, "port": host.port,
        "identity_file": host.identity_file, "proxy_jump": host.proxy_jump, "persist": host.persist,
        "inventory_file": host.inventory_file,
    }  # fmt: skip


def _error(payload: bytes) -> DflashError:
    data = json.loads(payload)
    cls = getattr(_errors, str(data.get("cls")), None)
    if not (isinstance(cls, type) and issubclass(cls, DflashError)):
        cls = DflashError
    return cls(str(data.get("msg")))


class _Pipe(Read1Stream):
    """stdout or stderr fed by the frame reader; `read1` returns what has arrived."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        self._error: BaseException | None = None

    def feed(self, data: bytes) -> None:
        """Append bytes from the frame reader and wake any waiting read1."""
        with self._cond:
            self._buf.extend(data)
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the end of the stream; once drained, read1 raises error if one is given, else returns b''."""
        with self._cond:
            self._eof = True
            self._error = error
            self._cond.notify_all()

    def read1(self, n: int = 65536) -> bytes:
        """Up to n bytes, blocking only until some arrive; b'' at end of stream."""
        with self._cond:
            while not self._buf and not self._eof:
                self._cond.wait()
            if not self._buf:
                if self._error is not None:
                    raise self._error
                return b""
            n = len(self._buf) if n is None or n < 0 else n
            data = bytes(self._buf[:n])
            del self._buf[:n]
            return data

    def close(self) -> None:
        """Nothing to release."""


class _Writer:
    """stdin of a mux command; close() sends EOF."""

    def __init__(self, proc: "_MuxProcess"):
        self._proc = proc
        self.closed = False

    def write(self, data: bytes) -> int:
        """Send data to the command's stdin as STDIN frames of at most 256 KiB."""
        view = memoryview(data)
        for start in range(0, len(view), 256 * 1024):
            self._proc._send(STDIN, bytes(view[start : start + 256 * 1024]))
        return len(data)

    def flush(self) -> None:
        """Writes are unbuffered."""

    def close(self) -> None:
        """Send EOF once; a command that has already ended is not an error."""
        if not self.closed:
            self.closed = True
            try:
                self._proc._send(EOF)
            except BrokenPipeError:
                pass


class _MuxProcess(Process):
    """A command run by the mux; behaves like the SSH transport's process."""

    def __init__(self, sock: socket.socket, name: str):
        self._sock = sock
        self._name = name
        self._send_lock = threading.Lock()
        self._done = threading.Event()
        self._code: int | None = None
        self._error: BaseException | None = None
        self._killed = False
        self.stdin = _Writer(self)  # type: ignore[assignment]
        self.stdout = _Pipe()  # type: ignore[assignment]
        self.stderr = _Pipe()  # type: ignore[assignment]
        threading.Thread(target=self._reader, daemon=True).start()

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        try:
            with self._send_lock:
                send_frame(self._sock, kind, payload)
        except OSError as exc:  # the command ended (or was killed): like writing to a closed pipe
            raise BrokenPipeError(f"stdin closed: {exc}") from None

    def _reader(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                try:
                    frame = recv_frame(self._sock)
                except OSError:
                    frame = None
                if frame is None:
                    if not self._killed:
                        error = ConnectionLost(f"connection to {self._name} lost")
                    break
                kind, payload = frame
                if kind == STDOUT:
                    self.stdout.feed(payload)  # type: ignore[attr-defined]
                elif kind == STDERR:
                    self.stderr.feed(payload)  # type: ignore[attr-defined]
                elif kind == CODE:
                    self._code = struct.unpack("!i", payload)[0]
                    break
                elif kind == ERROR:
                    error = _error(payload)
                    break
        finally:
            self._error = error
            self.stdout.finish(error)  # type: ignore[attr-defined]
            self.stderr.finish(error)  # type: ignore[attr-defined]
            self._done.set()
            try:
                self._sock.close()
            except OSError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ConnectError if the connection drops first, TimeoutError on timeout."""
        if not self._done.wait(timeout):
            raise TimeoutError
        if self._code is not None:
            return self._code
        if self._error is not None:
            raise self._error
        return 255  # killed

    def kill(self) -> None:
        """Close the channel (the mux closes it when it gets KILL or sees us hang up)."""
        self._killed = True
        try:
            self._send(KILL)
        except BrokenPipeError:
            pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class MuxTransport(Transport):
    """Runs argv through host's background mux; falls back to a direct SshTransport if it cannot."""

    def __init__(self, host: HostSpec, options: "SshOptions | None" = None):
        self.host = host
        self.name = host.name
        self.options = options
        self._direct: Transport | None = None
        self._lock = threading.Lock()

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv on the host via the mux (or directly when the mux cannot be used)."""
        if not argv:
            raise UsageError("empty command")
        if self._direct is None:
            try:
                return self._start_via_mux(argv, env)
            except MuxUnavailable as exc:
                log.debug("%s: mux unavailable, connecting directly: %s", self.name, exc)
                with self._lock:
                    if self._direct is None:
                        from .ssh import SshTransport

                        self._direct = SshTransport(self.host, self.options)
        return self._direct.start(argv, env)

    def _start_via_mux(self, argv: Sequence[str], env: dict[str, str] | None) -> Process:
        request = json.dumps({"argv": [str(a) for a in argv], "env": env}).encode()
        for _attempt in range(3):
            sock = self._socket()
            try:
                send_frame(sock, START, request)
                frame = recv_frame(sock)
            except OSError:
                frame = None
            except BaseException:  # a Ctrl-C: the command may have started; its owner stops it (guard.py)
                sock.close()
                raise
            if frame is None or frame[0] == GONE:
                sock.close()  # a mux on its way out: it ran nothing, so ask a fresh one
                time.sleep(0.05)
                continue
            kind, payload = frame
            if kind == STARTED:
                return _MuxProcess(sock, self.name)
            sock.close()
            if kind == ERROR:
                raise _error(payload)
            raise MuxUnavailable(f"unexpected frame {kind!r}")
        raise MuxUnavailable("the mux keeps going away")

    def _socket(self) -> socket.socket:
        path = socket_path(self.host, self.options)
        try:
            return connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        except OSError as exc:
            raise MuxUnavailable(f"{path}: {exc}") from None
        # Threads of one call start one mux: the first spawns it and waits for its socket, the
        # others find it up once they get the lock.
        with self._lock:
            try:
                return connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            except OSError as exc:
                raise MuxUnavailable(f"{path}: {exc}") from None
            _spawn(self.host, self.options, path)
            deadline = time.monotonic() + SPAWN_WAIT_S
            while time.monotonic() < deadline:
                try:
                    return connect(path)
                except (FileNotFoundError, ConnectionRefusedError):
                    time.sleep(0.01)
                except OSError as exc:
                    raise MuxUnavailable(f"{path}: {exc}") from None
        raise MuxUnavailable(f"the mux did not come up at {path}")

    def connected(self) -> bool:
        """Whether a command starts without connecting first: the direct connection is up, or a mux
        runs that has connected (asked over its socket: it answers at once, even while it connects)."""
        if self._direct is not None:
            return self._direct.connected()
        try:
            stats = _ask(socket_path(self.host, self.options), STATS)
        except MuxUnavailable:
            return False
        return stats is not None and stats.get("connects", 0) > 0

    def close(self) -> None:
        """The mux keeps the connection; only a direct fallback connection is closed."""
        if self._direct is not None:
            self._direct.close()
            self._direct = None


def _ask(path: Path, kind: bytes) -> dict | None:
    """Send a STATS or EXIT request to the mux at path; None when no mux answers there."""
    try:
        sock = connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    try:
        sock.settimeout(10)
        send_frame(sock, kind)
        frame = recv_frame(sock)
    except OSError:
        return None
    finally:
        sock.close()
    if frame is None or frame[0] != INFO:
        return None
    return json.loads(frame[1])


def mux_stats(host: HostSpec, options: "SshOptions | None" = None) -> dict | None:
    """The running mux's {pid, host, connects, channels, active, overflow, persist}, or None when none runs."""
    return _ask(socket_path(host, options), STATS)


def stop_mux(host: HostSpec, options: "SshOptions | None" = None) -> bool:
    """Ask host's mux to exit (like `ssh -O exit`); True when one was running."""
    return _ask(socket_path(host, options), EXIT) is not None


def stop_all_muxes() -> list[str]:
    """Stop every mux of ours; returns the host names that were running."""
    stopped = []
    for path in sorted(mux_dir().glob("*.sock")):
        try:
            answer = _ask(path, EXIT)
        except MuxUnavailable:
            continue
        if answer is not None:
            stopped.append(str(answer.get("host")))
    return stopped
