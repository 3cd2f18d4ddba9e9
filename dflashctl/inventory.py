"""hosts.yaml: where it is looked up, what a host entry holds, and validation with exact messages."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devices import host_gpus
from .errors import UsageError
from .yamlfile import load_yaml

ENV_VAR = "DFLASHCTL_INVENTORY"
LOCAL = "local"
TRANSPORTS = ("ssh", "local")
RUNTIMES = ("pct", "docker", "none")
DEFAULT_WORKDIR = "~/.dflashctl"
DEFAULT_TOOLS = {"pct": "/usr/sbin/pct", "docker": "docker"}  # the runtime's command on the host

# Connection reuse is on by default for ssh hosts, with a short idle time: measured on loopback
# (docs/push.md, docs/inspect.md), a new process per call, it is what makes a no-op push and a
# warm inspect cost less than rsync and a bare ssh read; without it every call pays Python
# start-up plus a full SSH handshake. `persist: 0` turns it off (docs/cli.md has the trade-off).
DEFAULT_PERSIST_S = 60
# A fork server waits this long for the next run on ssh hosts (docs/runs.md, "Warm starts"): each
# start after the first skips importing torch, the compiler and the trainer (docs/performance.md has
# the GPU measurements); it holds their memory while it waits. `fork_server: 0` turns it off.
DEFAULT_FORK_SERVER_S = 1800


@dataclass(frozen=True)
class ContainerSpec:
    """Where commands run on the host: a Proxmox LXC (`pct`), a docker container, or the host."""

    runtime: str = "none"
    vmid: int | None = None
    name: str | None = None
    tool: str | None = None  # `container.pct` / `container.docker` (e.g. podman); None: DEFAULT_TOOLS

    @property
    def executable(self) -> str:
        """The runtime's command on the host: `/usr/sbin/pct`, `docker`, or the configured one."""
        return self.tool or DEFAULT_TOOLS[self.runtime]

    def describe(self) -> str:
        """Short human form: `pct 200`, `docker trainer`, or `-`."""
        if self.runtime == "pct":
            return f"pct {self.vmid}"
        if self.runtime == "docker":
            return f"docker {self.name}"
        return "-"


@dataclass(frozen=True)
class HostSpec:
    """One host entry of hosts.yaml, validated."""

    name: str
    transport: str = "ssh"
    address: str | None = None
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    container: ContainerSpec = field(default_factory=ContainerSpec)
    python: str | None = None  # None on `local` means the interpreter running dflashctl
    workdir: str = DEFAULT_WORKDIR
    gpus: tuple[int, ...] = ()
    rendezvous_address: str | None = None
    persist: int = 0  # seconds a background mux keeps the SSH connection open between CLI calls; 0 = off
    # (hosts.yaml's default for ssh hosts is DEFAULT_PERSIST_S)
    # Seconds a fork server, which has imported torch and the trainer, waits in the container for the
    # next run to fork (a warm start, docs/runs.md); 0 = every run starts a new process. hosts.yaml's
    # default is DEFAULT_FORK_SERVER_S for ssh hosts (GPU boxes: it takes the imports off a start) and
    # 0 for `local` (the CPU demo and tests: no process left behind on the user's own machine).
    fork_server: int = 0
    on_event: tuple[str, ...] = ()  # argv run in the container at each run event (docs/runs.md)
    # The file the entry came from, as its errors name it (its full path: the file may be any of four
    # places); "hosts.yaml" for an entry made in code.
    inventory_file: str = field(default="hosts.yaml", compare=False)

    @property
    def interpreter(self) -> str:
        """The Python to run inside the container."""
        if self.python:
            return self.python
        return sys.executable if self.transport == "local" else "python3"

    def describe_address(self) -> str:
        """`user@address:port` as far as known, or `-` for local."""
        if self.transport == "local":
            return "-"
        text = self.address or self.name
        if self.user:
            text = f"{self.user}@{text}"
        if self.port:
            text = f"{text}:{self.port}"
        return text


@dataclass(frozen=True)
class Inventory:
    """All hosts, the default host's name, and the file they came from (None: built in)."""

    hosts: dict[str, HostSpec]
    default: str
    path: Path | None = None
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    searched: tuple[Path, ...] = ()  # built in: where a hosts.yaml was looked for

    def get(self, name: str | None) -> HostSpec:
        """The named host, or the default one when name is None."""
        key = name or self.default
        if key in self.hosts:
            return self.hosts[key]
        where = f" in {self.path}" if self.path else ""
        known = ", ".join(sorted(self.hosts)) or "none"
        raise UsageError(f"unknown host '{key}'{where} (known: {known}){self.none_found()}")

    def none_found(self) -> str:
        """`; no hosts.yaml found (...)` where no file was found, else '': a new user's file may be elsewhere."""
        if self.path or not self.searched:
            return ""
        looked = ", ".join(f"{p} (a directory)" if p.is_dir() else str(p) for p in self.searched)
        return f"; no hosts.yaml found (looked for {looked}; --inventory or ${ENV_VAR} names another)"

    def resolve_many(self, spec: str | None) -> list[HostSpec]:
        """Hosts named by `a,b`, a group name, or a single host."""
        if spec and spec in self.groups:
            return [self.get(n) for n in self.groups[spec]]
        names = [n.strip() for n in spec.split(",")] if spec else [None]
        if any(n == "" for n in names):
            raise UsageError(f"empty host name in '{spec}'")
        return [self.get(n) for n in names]


def completions(inv: Inventory, incomplete: str) -> list[tuple[str, str]]:
    """(name, description) of the hosts and groups starting with `incomplete`, for shell completion."""
    found = []
    for name, spec in sorted(inv.hosts.items()):
        parts = [part for part in (spec.describe_address(), spec.container.describe()) if part != "-"]
        found.append((name, " ".join(parts) or "this machine"))
    found += [(name, "group: " + ", ".join(members)) for name, members in sorted(inv.groups.items())]
    return [(name, about) for name, about in found if name.startswith(incomplete)]


def builtin_local() -> HostSpec:
    """The embedded default host: this machine, no container."""
    return HostSpec(name=LOCAL, transport="local")


def find_inventory(explicit: str | os.PathLike[str] | None, cwd: Path | None = None) -> Path | None:
    """First existing file of: --inventory, $DFLASHCTL_INVENTORY, ./hosts.yaml, ~/.config/dflashctl/hosts.yaml."""
    if explicit:
        return _named_file(Path(explicit).expanduser(), "")
    env = os.environ.get(ENV_VAR)
    if env:
        return _named_file(Path(env).expanduser(), f" (from ${ENV_VAR})")
    for candidate in _looked_up(cwd):
        if candidate.is_file():
            return candidate
    return None


def _looked_up(cwd: Path | None) -> tuple[Path, ...]:
    return (cwd or Path.cwd()) / "hosts.yaml", Path.home() / ".config/dflashctl/hosts.yaml"


def load_inventory(explicit: str | os.PathLike[str] | None = None, cwd: Path | None = None) -> Inventory:
    """Find and parse the inventory; with no file anywhere, only the built-in `local` host exists."""
    path = find_inventory(explicit, cwd)
    if path is None:
        return Inventory(hosts={LOCAL: builtin_local()}, default=LOCAL, searched=_looked_up(cwd))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_inventory(data, path)


def _named_file(path: Path, source: str) -> Path:
    """`path`, named by --inventory or the environment, if it is a file; else UsageError."""
    if path.is_dir():
        raise UsageError(f"inventory file {path} is a directory, not a file{source}")
    if not path.is_file():
        raise UsageError(f"inventory file not found: {path}{source}")
    return path


def parse_inventory(text: str | bytes, path: Path | None = None) -> Inventory:
    """Validate YAML text (bytes: UTF-8) into an Inventory; every error names the file, host and field."""
    label = str(path) if path else "hosts.yaml"  # the full path: the file may be any of four places
    data = load_yaml(text, label)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{label}: top level must be a mapping with a 'hosts:' key")
    unknown = set(data) - {"hosts", "default", "groups"}
    if unknown:
        raise UsageError(f"{label}: unknown top-level key '{sorted(unknown)[0]}' (expected hosts, default, groups)")
    raw_hosts = data.get("hosts") or {}
    if not isinstance(raw_hosts, dict):
        raise UsageError(f"{label}: 'hosts' must be a mapping of host name to settings")
    hosts: dict[str, HostSpec] = {}
    for name, raw in raw_hosts.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"{label}: host names must be non-empty strings, got {name!r}")
        if "," in name:
            raise UsageError(f"{label}: host '{name}': {_COMMA}")
        hosts[name] = _parse_host(label, name, raw)
    if LOCAL not in hosts:
        hosts[LOCAL] = builtin_local()
    default = data.get("default", LOCAL)
    if not isinstance(default, str) or default not in hosts:
        raise UsageError(f"{label}: default host '{default}' is not defined under hosts")
    groups = _parse_groups(label, data.get("groups") or {}, hosts)
    return Inventory(hosts=hosts, default=default, path=path, groups=groups)


_HOST_KEYS = {
    "transport",
    "address",
    "user",
    "port",
    "identity_file",
    "proxy_jump",
    "container",
    "python",
    "workdir",
    "gpus",
    "rendezvous_address",
    "persist",
    "fork_server",
    "on_event",
}
_COMMA = "a name cannot hold a comma (the command line reads h1,h2 as two hosts)"
_CONTAINER_KEYS = {"runtime", "vmid", "name", "pct", "docker"}
_DOCKER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


def _parse_host(label: str, name: str, raw: Any) -> HostSpec:
    def fail(msg: str) -> UsageError:
        return UsageError(f"{label}: host '{name}': {msg}")

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise fail(f"settings must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _HOST_KEYS
    if unknown:
        raise fail(f"unknown field '{sorted(unknown)[0]}'")

    transport = raw.get("transport", LOCAL if name == LOCAL else "ssh")
    if transport not in TRANSPORTS:
        raise fail(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    port = raw.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise fail(f"port must be an integer 1-65535, got {port!r}")
    strings = {}
    for key in ("address", "user", "identity_file", "proxy_jump", "python", "workdir", "rendezvous_address"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise fail(f"{key} must be a non-empty string, got {value!r}")
        strings[key] = value
    if transport == "local" and any(strings[k] for k in ("address", "user", "identity_file", "proxy_jump")) | (
        port is not None
    ):
        raise fail("address, user, port, identity_file and proxy_jump only apply to transport ssh")
    persist = _seconds(fail, raw, "persist", DEFAULT_PERSIST_S if transport == "ssh" else 0)
    if transport == "local" and persist:
        raise fail("persist only applies to transport ssh")
    gpus = host_gpus(raw.get("gpus"))
    if isinstance(gpus, str):
        raise fail(gpus)
    on_event = raw.get("on_event") or []
    if not isinstance(on_event, list) or not all(isinstance(a, str) and a for a in on_event):
        raise fail(f"on_event must be a command as a list of arguments, like [curl, -fsS, URL], got {on_event!r}")
    return HostSpec(
        name=name,
        transport=transport,
        address=strings["address"],
        user=strings["user"],
        port=port,
        identity_file=strings["identity_file"],
        proxy_jump=strings["proxy_jump"],
        container=_parse_container(fail, raw.get("container")),
        python=strings["python"],
        workdir=strings["workdir"] or DEFAULT_WORKDIR,
        gpus=gpus,
        rendezvous_address=strings["rendezvous_address"],
        persist=persist,
        fork_server=_seconds(fail, raw, "fork_server", DEFAULT_FORK_SERVER_S if transport == "ssh" else 0),
        on_event=tuple(on_event),
        inventory_file=label,
    )


def _seconds(fail: Any, raw: dict[str, Any], key: str, default: int) -> int:
    """A host's `key:` in seconds (0, or null: off), default when absent."""
    value = raw.get(key, default)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(f"{key} must be a non-negative integer (seconds; 0 = off), got {value!r}")
    return value


def _parse_container(fail: Any, raw: Any) -> ContainerSpec:
    if raw is None:
        return ContainerSpec()
    if not isinstance(raw, dict):
        raise fail(f"container must be a mapping like {{runtime: pct, vmid: 200}}, got {raw!r}")
    unknown = set(raw) - _CONTAINER_KEYS
    if unknown:
        raise fail(f"unknown field 'container.{sorted(unknown)[0]}'")
    runtime = raw.get("runtime", "none")
    if runtime not in RUNTIMES:
        raise fail(f"container.runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    for key in ("vmid", "name", "pct", "docker"):
        needs = "docker" if key in ("name", "docker") else "pct"
        if key in raw and runtime != needs:
            raise fail(f"container.{key} needs container.runtime {needs}")
    tool = raw.get(runtime)
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise fail(f"container.{runtime} must be a command or path, got {tool!r}")
    if runtime == "pct":
        vmid = raw.get("vmid")
        if vmid is None:
            raise fail("container.vmid is required for runtime pct (the container's id, like vmid: 200)")
        if isinstance(vmid, bool) or not isinstance(vmid, int):
            raise fail(f"container.vmid must be an integer, got {vmid!r}")
        if vmid < 100:
            raise fail(f"container.vmid must be 100 or more (Proxmox ids), got {vmid}")
        return ContainerSpec(runtime="pct", vmid=vmid, tool=tool)
    if runtime == "docker":
        cname = raw.get("name")
        if cname is None:
            raise fail("container.name is required for runtime docker (the container's name or id)")
        if not isinstance(cname, str) or not cname:
            raise fail(f"container.name must be the docker container's name, got {cname!r}")
        if not _DOCKER_NAME.fullmatch(cname):  # docker's own rule; also keeps a name from reading as an option
            raise fail(f"container.name must match [a-zA-Z0-9][a-zA-Z0-9_.-]* (a docker name or id), got {cname!r}")
        return ContainerSpec(runtime="docker", name=cname, tool=tool)
    return ContainerSpec()


def _parse_groups(label: str, raw: Any, hosts: dict[str, HostSpec]) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict):
        raise UsageError(f"{label}: 'groups' must map a group name to a list of hosts")
    groups = {}
    for gname, members in raw.items():
        if "," in str(gname):
            raise UsageError(f"{label}: group '{gname}': {_COMMA}")
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise UsageError(f"{label}: group '{gname}': must be a non-empty list of host names")
        for m in members:
            if m not in hosts:
                raise UsageError(f"{label}: group '{gname}': unknown host '{m}'")
        if gname in hosts:
            raise UsageError(f"{label}: group '{gname}': name clashes with a host")
        groups[gname] = tuple(members)
    return groups
