"""`dflashctl hosts trust`: fetch a host's key with a bare handshake, show its fingerprint and
record it in known_hosts; a key that differs from a recorded one is refused, never replaced."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console

from .errors import ConnectError, DflashError, UsageError
from .inventory import HostSpec
from .ssh import (
    SshOptions,
    SshTransport,
    fingerprint,
    load_known_hosts,
    mapped_errors,
    paramiko,
    resolve_endpoint,
    retrying,
)


def trust_host(host: HostSpec, confirm: Callable[[str], bool] | None, options: SshOptions | None = None) -> None:
    """Show the host's key fingerprint, ask (unless confirm is None), and append it to known_hosts."""
    options = options or SshOptions()
    if host.transport != "ssh":
        raise UsageError(f"{host.name}: transport is {host.transport}, there is no SSH key to trust")
    ep = resolve_endpoint(host, options)
    known = load_known_hosts(options).lookup(ep.known_name) or {}
    key = fetch_host_key(host, options, prefer=list(known.keys()))
    out = Console(highlight=False)
    recorded = known.get(key.get_name())
    if recorded is None and known:
        # We asked for the recorded type first; a server that offers another one no longer has
        # the key we know: treat it as a changed key, never as a new host.
        have = ", ".join(f"{name} {fingerprint(k)}" for name, k in known.items())
        raise ConnectError(
            f"{host.name}: {ep.known_name} offers a {key.get_name()} key {fingerprint(key)}, but a different key is "
            f"already known for this host ({have}); refusing. If the host was reinstalled: "
            f"ssh-keygen -R '{ep.known_name}' -f {options.known_hosts()}, then dflashctl hosts trust {host.name}"
        )
    if recorded is not None and recorded != key:
        raise ConnectError(
            f"{host.name}: {ep.known_name} now offers {fingerprint(key)} but known_hosts has {fingerprint(recorded)}; "
            f"refusing to replace a recorded key "
            f"(remove it with: ssh-keygen -R '{ep.known_name}' -f {options.known_hosts()})"
        )
    if recorded is not None:
        out.print(
            f"{host.name}: {ep.known_name} {key.get_name()} {fingerprint(key)} is already trusted", soft_wrap=True
        )
        return
    out.print(
        f"{host.name}: {ep.known_name} offers {key.get_name()} key {fingerprint(key)}", soft_wrap=True
    )  # one line
    if confirm is not None and not confirm("Trust this key and record it in known_hosts?"):
        raise DflashError(f"{host.name}: not trusted; nothing recorded")
    path = options.known_hosts()
    _append_known_host(path, f"{ep.known_name} {key.get_name()} {key.get_base64()}")
    out.print(f"recorded in {path}", soft_wrap=True)


RSA_TYPES = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")


def fetch_host_key(host: HostSpec, options: SshOptions, prefer: Sequence[str] = ()) -> paramiko.PKey:
    """The host's public key from a bare handshake (no authentication), through ProxyJump if set."""
    via = SshTransport(host, options)
    ep = via.endpoint

    def handshake() -> paramiko.PKey:
        sock = via.open_socket(ep)
        session = paramiko.Transport(sock)
        try:
            if prefer:  # ask for the key type already on record, so a comparison is meaningful
                opts = session.get_security_options()
                # known_hosts names RSA keys `ssh-rsa`; paramiko negotiates them as rsa-sha2-*, and
                # may no longer offer `ssh-rsa` itself: only types it knows can be asked for first.
                wanted = [t for k in prefer for t in (RSA_TYPES if k == "ssh-rsa" else (k,)) if t in opts.key_types]
                opts.key_types = [*wanted, *(k for k in opts.key_types if k not in wanted)]
            session.banner_timeout = options.connect_timeout
            with mapped_errors(ep, options):
                session.start_client(timeout=2 * options.connect_timeout)
                return session.get_remote_server_key()
        finally:
            session.close()

    try:
        return retrying(options, handshake)
    finally:
        via.close()


def _append_known_host(path: Path, line: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = path.read_bytes() if path.exists() else b""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "ab") as fh:
        if existing and not existing.endswith(b"\n"):
            fh.write(b"\n")
        fh.write(line.encode() + b"\n")
