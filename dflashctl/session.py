"""One CLI call's state: the inventory plus one lazily opened connection per host."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .containers import Target
from .inventory import HostSpec, Inventory
from .transport import LocalTransport, Transport

if TYPE_CHECKING:
    from .ssh import SshOptions


class Session:
    """Hands out Targets; each host is connected at most once per call and closed at the end."""

    def __init__(self, inventory: Inventory, ssh_options: "SshOptions | None" = None):
        self.inventory = inventory
        self.ssh_options = ssh_options  # None: ~/.ssh of $HOME at connect time
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()  # multi-host commands ask for transports from several threads

    def host(self, name: str | None) -> HostSpec:
        """The named (or default) host's settings."""
        return self.inventory.get(name)

    def target(self, name: str | None) -> Target:
        """A Target for the named (or default) host; connects on first use."""
        return Target(self.host(name), self.transport(self.host(name)))

    def transport(self, host: HostSpec) -> Transport:
        """The transport for host, created once per session (SSH connects lazily on first command)."""
        with self._lock:
            if host.name not in self._transports:
                if host.transport == "local":
                    self._transports[host.name] = LocalTransport(host.name)
                elif host.persist > 0:  # a background mux keeps the connection between calls
                    from .mux import MuxTransport

                    self._transports[host.name] = MuxTransport(host, self.ssh_options)
                else:
                    from .ssh import SshTransport

                    self._transports[host.name] = SshTransport(host, self.ssh_options)
            return self._transports[host.name]

    def reconnect(self, name: str | None) -> Target:
        """A Target on a fresh connection to the host, after the old one dropped or stalled."""
        host = self.host(name)
        with self._lock:
            stale = self._transports.pop(host.name, None)
        if stale is not None:
            try:
                stale.close()
            except Exception:  # noqa: BLE001 - a dead connection may fail to close; it is dropped anyway
                pass
        return self.target(name)

    def close(self) -> None:
        """Close every open connection."""
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
