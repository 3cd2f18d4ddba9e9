"""The `ssh` transport on paramiko: ~/.ssh/config, known_hosts, one reused connection per CLI call.

Security stance: a host key must already be in known_hosts (`dflashctl hosts trust HOST` records
it); an unknown key is refused and a changed key is always refused. Commands are argv lists
joined with `shlex.join` for the remote login shell (POSIX sh quoting: bash, dash, zsh).
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import logging
import shlex
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar


def _import_paramiko():  # type: ignore[no-untyped-def]
    """paramiko without `invoke`: paramiko.config imports it (~170 ms, a third of a remote
    command's start-up) only to run `Match exec` lines; `_ssh_config` attaches it on demand."""
    blocked = "invoke" not in sys.modules
    if blocked:
        sys.modules["invoke"] = None  # type: ignore[assignment]  # makes `import invoke` fail fast
    try:
        import paramiko
    finally:
        if blocked:
            del sys.modules["invoke"]
    return paramiko


paramiko = _import_paramiko()

from .errors import ConnectError, ConnectionLost, DflashError, UsageError  # noqa: E402
from .inventory import HostSpec  # noqa: E402
from .transport import Process, Read1Stream, Transport, env_argv  # noqa: E402

T = TypeVar("T")

# paramiko logs socket errors at ERROR level; with no handler configured Python would print them
# to stderr next to our own one-line message. The CLI reports every failure itself.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# A bigger window than paramiko's 2 MiB keeps bulk transfers (pushes, checkpoints) flowing.
WINDOW_SIZE = 16 * 1024 * 1024
MAX_PACKET = 32 * 1024
WRITE_PIECE = 256 * 1024
DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
MAX_JUMPS = 8


@dataclass(frozen=True)
class SshOptions:
    """Where ~/.ssh lives and how patient to be; `home=None` means $HOME at call time.

    Passing `home` lets in-process callers (tests) point at another ~/.ssh without touching
    os.environ. `~` inside ~/.ssh/config itself is still expanded by paramiko with $HOME.
    """

    home: Path | None = None
    agent: bool = True
    connect_timeout: float = 10.0
    keepalive_s: int = 15
    attempts: int = 3
    backoff_s: float = 0.5

    def ssh_dir(self) -> Path:
        """The ~/.ssh directory these options refer to."""
        return (self.home or Path.home()) / ".ssh"

    def known_hosts(self) -> Path:
        """The user's known_hosts file (read, and appended to by `hosts trust`)."""
        return self.ssh_dir() / "known_hosts"

    def expand(self, path: str) -> Path:
        """Expand a leading `~` against this home rather than the process's."""
        if path == "~" or path.startswith("~/"):
            return (self.home or Path.home()) / path[2:]
        return Path(path).expanduser()


@dataclass(frozen=True)
class Endpoint:
    """Where one host really is, after merging hosts.yaml over ~/.ssh/config."""

    name: str  # the inventory name, for messages
    hostname: str
    port: int
    user: str
    identity_files: tuple[Path, ...]
    proxy_jump: str | None

    @property
    def known_name(self) -> str:
        """The host's name in known_hosts: `host`, or `[host]:port` off port 22."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def check_identity_file(host: HostSpec, path: Path) -> None:
    """hosts.yaml's identity_file must be a readable private key file (UsageError naming the inventory
    file, the host and the key)."""
    where = f"{host.inventory_file}: host '{host.name}': identity_file {host.identity_file}"
    if not path.exists():
        raise UsageError(f"{where}: no such file")
    if path.is_dir():
        raise UsageError(f"{where}: is a directory, not a key file")
    try:
        head = path.read_bytes()[:4096]
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it ({exc.strerror})") from None
    if head.startswith((b"ssh-", b"ecdsa-", b"sk-")):
        raise UsageError(f"{where}: is a public key; name the private key (without .pub)")
    if b"PRIVATE KEY-----" not in head:
        raise UsageError(f"{where}: is not a private key (expected '-----BEGIN ... PRIVATE KEY-----')")
    try:
        paramiko.PKey.from_path(path)
    except TypeError:
        pass  # encrypted (cryptography's TypeError): the connection says what to do about its passphrase
    except Exception as exc:  # noqa: BLE001 - whatever the key parsers raise, the key cannot be used
        raise UsageError(f"{where}: cannot be loaded as a private key ({exc})") from None


def resolve_endpoint(host: HostSpec, options: SshOptions) -> Endpoint:
    """Merge a host entry with ~/.ssh/config: values in hosts.yaml win, then the config, then defaults."""
    alias = host.address or host.name
    config = _ssh_config(options).lookup(alias)
    identities = [host.identity_file] if host.identity_file else config.get("identityfile", [])
    paths = tuple(options.expand(p) for p in identities)
    if host.identity_file:
        check_identity_file(host, paths[0])
    if not paths:
        paths = tuple(p for p in (options.ssh_dir() / k for k in DEFAULT_KEYS) if p.is_file())
    jump = host.proxy_jump or config.get("proxyjump")
    try:
        port = host.port or int(config.get("port", 22))
    except ValueError:
        raise UsageError(f"{host.name}: ~/.ssh/config gives a bad Port for '{alias}'") from None
    return Endpoint(
        name=host.name,
        hostname=config.get("hostname", alias),
        port=port,
        user=host.user or config.get("user") or getpass.getuser(),
        identity_files=paths,
        proxy_jump=None if (jump or "").lower() == "none" else jump,
    )


def _ssh_config(options: SshOptions) -> paramiko.SSHConfig:
    path = options.ssh_dir() / "config"
    if not path.is_file():
        return paramiko.SSHConfig()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        if re.search(r"^\s*match\b.*\bexec\b", text, re.I | re.M):
            import invoke  # `Match exec` needs it (see _import_paramiko)

            paramiko.config.invoke = invoke
        return paramiko.SSHConfig.from_text(text)
    except (OSError, paramiko.ConfigParseError) as exc:
        raise UsageError(f"{path}: cannot parse: {exc}") from None


def fingerprint(key: paramiko.PKey) -> str:
    """`SHA256:...` as `ssh-keygen -lf` prints it (unpadded base64 of the key blob's SHA-256)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(options: SshOptions) -> paramiko.HostKeys:
    """The system and user known_hosts merged (hashed entries included)."""
    keys = paramiko.HostKeys()
    for path in (SYSTEM_KNOWN_HOSTS, options.known_hosts()):
        if path.is_file():
            try:
                keys.load(str(path))
            except (OSError, paramiko.SSHException) as exc:
                raise ConnectError(f"{path}: cannot read known_hosts: {exc}") from None
    return keys


class _UnknownHostKey(Exception):
    """Raised from inside paramiko's handshake when known_hosts has no key for the host."""

    def __init__(self, key: paramiko.PKey):
        super().__init__("unknown host key")
        self.key = key


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(key)


class _Transient(Exception):
    """A failure worth retrying (refused, reset, no banner): wraps the one-line message."""


class _Overflow:
    """An extra connection opened because the others refused a session, and the channels it carries."""

    def __init__(self, client: paramiko.SSHClient):
        self.client = client
        self.channels: list[paramiko.Channel] = []

    def idle(self) -> bool:
        """True when every channel it carried has closed (or the connection is dead)."""
        self.channels = [ch for ch in self.channels if not ch.closed]
        transport = self.client.get_transport()
        return not self.channels or transport is None or not transport.is_active()


class SshTransport(Transport):
    """Runs argv on one host over a lazily opened paramiko connection, plus overflow connections
    while the server refuses more sessions on it (OpenSSH's MaxSessions, default 10)."""

    def __init__(self, host: HostSpec, options: SshOptions | None = None, _depth: int = 0):
        self.host = host
        self.name = host.name
        self.options = options or SshOptions()
        self._depth = _depth
        self._lock = threading.Lock()
        self._client: paramiko.SSHClient | None = None
        self._hops: list[SshTransport] = []
        self._overflow_lock = threading.Lock()
        self._overflow: list[_Overflow] = []

    @property
    def endpoint(self) -> Endpoint:
        """The resolved address, port, user and keys of this host."""
        return resolve_endpoint(self.host, self.options)

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Process:
        """Start argv on the host; `env` is applied with `env -- K=V argv` since sshd drops most variables."""
        if not argv:
            raise UsageError("empty command")
        # Arguments that are not UTF-8 arrive as surrogate escapes (PEP 383); send their bytes as
        # they were given, as OpenSSH does.
        command = shlex.join(env_argv(argv, env)).encode("utf-8", "surrogateescape")
        transport, channel = self._open_channel()
        try:
            channel.exec_command(command)
            return _SshProcess(channel, transport, self._lost)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if not transport.is_active():
                raise self._lost() from None
            raise ConnectError(f"{self.name}: cannot start command: {exc}") from None
        except BaseException:  # a Ctrl-C: the command may have started; its owner stops it (guard.py)
            channel.close()
            raise

    def connected(self) -> bool:
        """Whether the connection is up (a command starts on it without connecting). No lock: a
        thread connecting holds it, and `_client` is only set once a connect has completed."""
        client = self._client
        transport = client.get_transport() if client is not None else None
        return transport is not None and transport.is_active()

    def _open_channel(self) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A new session channel; reconnects once if the connection turns out to be dead (nothing ran yet)."""
        for attempt in range(2):
            transport = self.connection()
            try:
                return transport, self._session(transport)
            except paramiko.ChannelException:
                # OpenSSH refuses sessions beyond its MaxSessions (default 10) per connection.
                return self._overflow_channel()
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if isinstance(exc, paramiko.SSHException) and transport.is_active():
                    # A refusal too: paramiko hands it to only one of the threads opening at once,
                    # the others get "Unable to open channel." on the live connection.
                    return self._overflow_channel()
                if attempt == 0 and self._wait_dead(transport):
                    continue
                raise ConnectError(f"{self.name}: cannot open a session: {exc}") from None
        raise self._lost()

    def _session(self, transport: paramiko.Transport) -> paramiko.Channel:
        return transport.open_session(
            window_size=WINDOW_SIZE, max_packet_size=MAX_PACKET, timeout=self.options.connect_timeout
        )

    def _overflow_channel(self) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A session on an overflow connection with room, or on a new one (as OpenSSH's ControlMaster
        falls back to a connection of its own); one at a time, so a burst opens only the connections it needs."""
        with self._overflow_lock:
            self._trim_locked()
            for extra in self._overflow:
                transport = extra.client.get_transport()
                try:
                    channel = self._session(transport)
                except (paramiko.SSHException, EOFError, OSError):  # full (ChannelException) or dying
                    continue
                extra.channels.append(channel)
                return transport, channel
            extra = _Overflow(retrying(self.options, self._connect_once))
            self._overflow.append(extra)  # before its first session, so close() covers it
            transport = extra.client.get_transport()
            transport.set_keepalive(self.options.keepalive_s)
            try:
                channel = self._session(transport)
            except paramiko.ChannelException as exc:  # refused on a fresh connection: not a matter of load
                raise ConnectError(f"{self.name}: the server refused a new session: {exc.text}") from None
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectError(f"{self.name}: cannot open a session: {exc}") from None
            extra.channels.append(channel)
            return transport, channel

    def trim(self) -> int:
        """Close overflow connections whose commands have all ended; returns how many stay open."""
        with self._overflow_lock:
            self._trim_locked()
            return len(self._overflow)

    def _trim_locked(self) -> None:
        keep = []
        for extra in self._overflow:
            if extra.idle():
                extra.client.close()
            else:
                keep.append(extra)
        self._overflow = keep

    @staticmethod
    def _wait_dead(transport: paramiko.Transport, patience: float = 1.0) -> bool:
        """True once paramiko marks the transport dead (it lags a moment behind the socket error)."""
        deadline = time.monotonic() + patience
        while transport.is_active() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not transport.is_active()

    def connection(self) -> paramiko.Transport:
        """The live paramiko transport, connecting (or reconnecting after a drop) on demand."""
        with self._lock:
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return transport
                self._close_locked()
            self._client = retrying(self.options, self._connect_once)
            transport = self._client.get_transport()
            assert transport is not None
            transport.set_keepalive(self.options.keepalive_s)
            return transport

    def close(self) -> None:
        """Close the connection, its overflow connections and any jump hosts behind them."""
        with self._overflow_lock:
            for extra in self._overflow:
                extra.client.close()
            self._overflow = []
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for hop in self._hops:
            hop.close()
        self._hops.clear()

    def _lost(self) -> ConnectError:
        return ConnectionLost(f"connection to {self.name} lost")

    def _connect_once(self) -> paramiko.SSHClient:
        ep = self.endpoint
        sock = self.open_socket(ep)
        client = paramiko.SSHClient()
        for path in (SYSTEM_KNOWN_HOSTS, self.options.known_hosts()):
            if path.is_file():  # loaded as "system" keys: checked, never written back by paramiko
                client.load_system_host_keys(str(path))
        client.set_missing_host_key_policy(_RefuseUnknown())
        timeout = self.options.connect_timeout
        try:
            with mapped_errors(ep, self.options):
                client.connect(
                    ep.hostname,
                    ep.port,
                    username=ep.user,
                    sock=sock,
                    key_filename=[str(p) for p in ep.identity_files] or None,
                    allow_agent=self.options.agent,
                    look_for_keys=False,
                    # paramiko's handshake wait must outlast its banner wait, or it gives up
                    # silently and the failure surfaces later as "No existing session".
                    timeout=2 * timeout,
                    banner_timeout=timeout,
                    auth_timeout=timeout,
                    channel_timeout=timeout,
                )
        except BaseException:
            client.close()
            sock.close()
            raise
        return client

    def open_socket(self, ep: Endpoint) -> socket.socket | paramiko.Channel:
        """A byte stream to the host's sshd: direct TCP, or a channel through the ProxyJump chain."""
        if ep.proxy_jump:
            return self._jump(ep)
        with mapped_errors(ep, self.options):
            sock = socket.create_connection((ep.hostname, ep.port), timeout=self.options.connect_timeout)
        _tune_socket(sock)
        return sock

    def _jump(self, ep: Endpoint) -> paramiko.Channel:
        if self._depth >= MAX_JUMPS:
            raise UsageError(f"{self.name}: ProxyJump chain is longer than {MAX_JUMPS} hops (a loop in ~/.ssh/config?)")
        *earlier, last = [h.strip() for h in (ep.proxy_jump or "").split(",")]
        if not self._hops:  # overflow connections go through the same hop connection as the main one
            self._hops.append(SshTransport(_hop_spec(last, ",".join(earlier) or None), self.options, self._depth + 1))
        hop = self._hops[0]
        try:
            return hop.connection().open_channel(
                "direct-tcpip", (ep.hostname, ep.port), ("127.0.0.1", 0), timeout=self.options.connect_timeout
            )
        except paramiko.ChannelException as exc:
            raise ConnectError(
                f"{ep.name}: jump host {last} cannot reach {ep.hostname}:{ep.port}: {exc.text}"
            ) from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(f"{ep.name}: jump host {last} failed: {exc}") from None


def _hop_spec(hop: str, earlier: str | None) -> HostSpec:
    """A HostSpec for one `[user@]host[:port]` ProxyJump hop; earlier hops become its own ProxyJump."""
    user, _, rest = hop.rpartition("@")
    address, port = rest, None
    if rest.startswith("["):  # [v6::addr]:port
        address, _, tail = rest[1:].partition("]")
        port = tail[1:] or None
    elif rest.count(":") == 1:
        address, port = rest.split(":")
    if port is not None and not port.isdigit():
        raise UsageError(f"bad ProxyJump hop '{hop}'")
    return HostSpec(
        name=address, address=address, user=user or None, port=int(port) if port else None, proxy_jump=earlier
    )


def _tune_socket(sock: socket.socket) -> None:
    """No Nagle delay (it costs ~40 ms per channel open), and a dead peer noticed within about a
    minute: TCP keepalive covers idle links, TCP_USER_TIMEOUT links with unacknowledged data (such
    as paramiko's own keepalives, which alone never detect anything)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 60_000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def retrying(options: SshOptions, attempt: Callable[[], T]) -> T:
    """Call attempt, retrying transient failures with exponential backoff a bounded number of times."""
    for n in range(options.attempts):
        try:
            return attempt()
        except _Transient as exc:
            if n + 1 >= options.attempts:
                raise ConnectError(f"{exc} (after {options.attempts} attempts)") from None
            time.sleep(options.backoff_s * 2**n)
    raise AssertionError("unreachable")


class mapped_errors:
    """Context manager turning socket/paramiko failures into one-line ConnectErrors (or _Transient)."""

    def __init__(self, ep: Endpoint, options: SshOptions):
        self.ep = ep
        self.options = options

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, (DflashError, _Transient)):
            return False
        message = _describe(self.ep, self.options, exc)
        if message is None:
            return False
        if isinstance(message, _Transient):
            raise message from None
        raise ConnectError(message) from None


def _describe(ep: Endpoint, options: SshOptions, exc: BaseException) -> str | _Transient | None:
    where = f"{ep.hostname}:{ep.port}"
    if isinstance(exc, _UnknownHostKey):
        known = load_known_hosts(options).lookup(ep.known_name) or {}
        if known:
            have = ", ".join(f"{name} {fingerprint(k)}" for name, k in known.items())
            return (
                f"{ep.name}: {ep.known_name} offers a {exc.key.get_name()} key {fingerprint(exc.key)}, but a different "
                f"key is already known for this host ({have}); refusing to connect. If the host was reinstalled: "
                f"ssh-keygen -R '{ep.known_name}' -f {options.known_hosts()}, then dflashctl hosts trust {ep.name}"
            )
        return (
            f"{ep.name}: unknown host key for {ep.known_name} ({exc.key.get_name()} {fingerprint(exc.key)}); "
            f"check it, then run: dflashctl hosts trust {ep.name}"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"{ep.name}: host key for {ep.known_name} has CHANGED (server offers {fingerprint(exc.key)}, "
            f"known_hosts has {fingerprint(exc.expected_key)}); refusing to connect. If the host was reinstalled: "
            f"ssh-keygen -R '{ep.known_name}' -f {options.known_hosts()}, then dflashctl hosts trust {ep.name}"
        )
    if isinstance(exc, paramiko.PasswordRequiredException):  # a subclass of the next: test it first
        keys = ", ".join(str(p) for p in ep.identity_files) or "the key"
        return (
            f"{ep.name}: {keys} is protected by a passphrase, which dflashctl does not ask for; load it into "
            f"ssh-agent (ssh-add {keys.split(', ')[0]}) or use a key without a passphrase"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        tried = ", ".join([*(str(p) for p in ep.identity_files), *(["agent"] if options.agent else [])]) or "no keys"
        return (
            f"{ep.name}: authentication failed for {ep.user}@{where} (tried {tried}); "
            f"set identity_file or load the key into ssh-agent"
        )
    if isinstance(exc, socket.gaierror):
        return f"{ep.name}: cannot resolve host '{ep.hostname}'"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"{ep.name}: timed out connecting to {where} after {options.connect_timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return _Transient(f"{ep.name}: connection refused by {where} (is sshd running, is the port right?)")
    if isinstance(exc, (ConnectionResetError, EOFError)):
        return _Transient(f"{ep.name}: connection reset by {where}")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "banner" in text.lower():
            return _Transient(f"{ep.name}: no SSH banner from {where} (is it an SSH server?)")
        if text in ("No existing session", "Negotiation failed."):
            return _Transient(f"{ep.name}: SSH handshake with {where} did not complete")
        return f"{ep.name}: SSH handshake with {where} failed: {text}"
    if isinstance(exc, OSError):
        return f"{ep.name}: cannot connect to {where}: {exc.strerror or exc}"
    return None


class _ChannelReader(Read1Stream):
    """stdout or stderr of a channel as a stream whose `read1` returns what is available."""

    def __init__(self, channel: paramiko.Channel, stderr: bool, lost: Callable[[], ConnectError]):
        self._recv = channel.recv_stderr if stderr else channel.recv
        self._channel = channel
        self._lost = lost

    def read1(self, n: int = 65536) -> bytes:
        """Up to n bytes, blocking only until some arrive; b'' at end of stream."""
        try:
            data = self._recv(n)
        except (EOFError, OSError, paramiko.SSHException):  # recv also sends window updates: a dead socket
            raise self._lost() from None
        if not data and not self._channel.eof_received and not self._channel.get_transport().is_active():
            raise self._lost()
        return data

    def close(self) -> None:
        """Nothing to release: the channel is closed by the process."""


class _ChannelWriter:
    """stdin of a channel; close() sends EOF so the command sees end of input."""

    def __init__(self, channel: paramiko.Channel):
        self._channel = channel
        self.closed = False

    def write(self, data: bytes) -> int:
        """Send all of data, blocking while the remote window is full."""
        # paramiko's sendall re-slices its whole argument per packet: feed it bounded pieces,
        # or a 50 MB write costs gigabytes of copying.
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            self._channel.sendall(bytes(view[start : start + WRITE_PIECE]))
        return len(data)

    def flush(self) -> None:
        """Writes are unbuffered."""

    def close(self) -> None:
        """Send EOF on stdin (once)."""
        if not self.closed:
            self.closed = True
            if not self._channel.closed:
                self._channel.shutdown_write()


class _SshProcess(Process):
    """A command running in one channel of the shared connection."""

    def __init__(self, channel: paramiko.Channel, transport: paramiko.Transport, lost: Callable[[], ConnectError]):
        self._channel = channel
        self._transport = transport
        self._lost = lost
        self.stdin = _ChannelWriter(channel)  # type: ignore[assignment]
        self.stdout = _ChannelReader(channel, False, lost)  # type: ignore[assignment]
        self.stderr = _ChannelReader(channel, True, lost)  # type: ignore[assignment]

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ConnectError if the connection drops first, TimeoutError on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._channel.status_event.wait(0.25):
            if not self._transport.is_active():
                raise self._lost()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        if self._channel.exit_status != -1:
            return self._channel.exit_status
        # Closed without an exit status: a dropped connection, or a command killed by a signal
        # (paramiko ignores exit-signal; a guarded command's guard exits 255 for it instead, so this
        # wait is for unguarded ones). The transport notices a drop just after the channel does.
        for _ in range(20):
            if not self._transport.is_active():
                raise self._lost()
            time.sleep(0.05)
        return 255  # what the OpenSSH client reports when no exit status arrives

    def kill(self) -> None:
        """Close the channel. Without a pty sshd sends no signal; the command sees EOF and SIGPIPE."""
        try:
            self._channel.close()
        except (EOFError, OSError, paramiko.SSHException):
            pass  # the connection is already gone, and the command with it
