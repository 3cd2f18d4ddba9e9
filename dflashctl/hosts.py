"""`dflashctl hosts`: the inventory as a table, and `check`, which walks a host from SSH to GPUs."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from rich.console import Console
from rich.text import Text

from .containers import Target
from .errors import ContainerError, DflashError
from .inventory import HostSpec, Inventory
from .session import Session
from .tables import Column, notes, show

CHECK_TIMEOUT_S = 180  # the remote probe imports torch, which can take a while on a cold disk


@dataclass(frozen=True)
class Check:
    """One row of `hosts check`: what was checked, whether it passed, what was seen, what to do."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


def print_host_table(console: Console, inventory: Inventory) -> None:
    """`hosts list`: the inventory; the default host is marked with `*`."""
    title = f"hosts from {inventory.path}" if inventory.path else "hosts (built in: no hosts.yaml found)"
    columns = [
        Column("default"),
        Column("name"),
        Column("transport"),
        Column("address"),
        Column("container"),
        Column("python", text=True),
        Column("gpus"),
    ]
    rows = [
        [
            "*" if name == inventory.default else "",
            name,
            host.transport,
            host.describe_address(),
            host.container.describe(),
            host.interpreter,
            ",".join(map(str, host.gpus)) or "-",
        ]
        for name, host in inventory.hosts.items()
    ]
    show(console, columns, rows, title=title)


def check_host(session: Session, name: str | None) -> list[Check]:
    """Check a host step by step; stop at the first step that makes the later ones meaningless."""
    host = session.host(name)
    checks = [_check_reachable(session, host)]
    if not checks[-1].ok:
        return checks
    target = session.target(host.name)
    checks.append(_check_container(target))
    if not checks[-1].ok:
        return checks
    try:
        result = target.python("check", timeout=CHECK_TIMEOUT_S)
    except ContainerError as exc:  # the interpreter is missing
        return [*checks, Check("interpreter", False, str(exc), f"set `python` for {host.name} in hosts.yaml")]
    if not result.ok:
        return [*checks, Check("interpreter", False, f"{host.interpreter}: {result.err_line()}", "needs Python 3.8+")]
    try:
        info = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [
            *checks,
            Check("interpreter", False, f"{host.interpreter}: unreadable probe output", "run with --debug"),
        ]
    return [*checks, *_interpreter_checks(host, info)]


def check_hosts(session: Session, hosts: Sequence[HostSpec]) -> dict[str, list[Check]]:
    """check_host on every host at once, one thread each; an error ends that host's rows only."""
    from .multihost import parallel

    results = {}
    for host, answer in zip(hosts, parallel(lambda h: check_host(session, h.name), hosts)):
        if isinstance(answer, DflashError):  # e.g. the connection dropped during the probe
            answer = [Check("error", False, str(answer))]
        elif isinstance(answer, BaseException):
            raise answer
        results[host.name] = answer
    return results


def _check_reachable(session: Session, host: HostSpec) -> Check:
    if host.transport == "local":
        return Check("reachable", True, "local (this machine)")
    from .ssh import SshTransport

    transport = session.transport(host)
    own = not isinstance(transport, SshTransport)  # a persist host's mux: check with a direct connection
    if own:
        transport = SshTransport(host, session.ssh_options)
    started = time.monotonic()
    try:
        transport.connection()
    except DflashError as exc:
        text = str(exc)
        if "CHANGED" in text or "different key is already known" in text:
            hint = "find out why the key changed; then ssh-keygen -R and dflashctl hosts trust (see detail)"
        elif "hosts trust" in text:
            hint = f"dflashctl hosts trust {host.name}"
        else:
            hint = "check address, port and keys"
        return Check("reachable", False, str(exc), hint)
    finally:
        if own:
            transport.close()
    ep = transport.endpoint
    ms = (time.monotonic() - started) * 1000
    via = f" via {ep.proxy_jump}" if ep.proxy_jump else ""
    return Check("reachable", True, f"ssh {ep.user}@{ep.hostname}:{ep.port}{via} ({ms:.0f} ms)")


def _check_container(target: Target) -> Check:
    spec = target.host.container
    if spec.runtime == "none":
        return Check("container", True, "none (commands run on the host)")
    if spec.runtime == "pct":
        argv, want, hint = [spec.executable, "status", str(spec.vmid)], "status: running", f"pct start {spec.vmid}"
    else:
        argv = [spec.executable, "inspect", "-f", "{{.State.Running}}", str(spec.name)]
        want, hint = "true", f"docker start {spec.name}"
    try:
        result = target.transport.run(argv, timeout=60)
    except DflashError as exc:
        return Check("container", False, str(exc), hint)
    seen = result.text().strip()
    if result.ok and seen == want:
        return Check("container", True, f"{spec.describe()} running")
    if result.ok:
        return Check("container", False, f"{spec.describe()} is not running ({seen})", hint)
    if result.exit_code == 127:
        return Check(
            "container",
            False,
            f"`{argv[0]}` not found on {target.host.name}",
            f"set container.{spec.runtime} to its path, or install it",
        )
    return Check(
        "container", False, f"{spec.describe()}: {result.err_line()}", "check the container id/name in hosts.yaml"
    )


def _interpreter_checks(host: HostSpec, info: dict[str, Any]) -> list[Check]:
    """Rows for the interpreter, torch, triton, CUDA and nvidia-smi from the remote probe's answer."""
    rows = [Check("interpreter", True, f"Python {info.get('python')} ({info.get('executable')})")]
    wants_gpus = bool(host.gpus)
    if "torch" in info:
        rows.append(Check("torch", True, str(info["torch"])))
    else:
        rows.append(Check("torch", False, str(info.get("torch_error")), f"pip install torch with {host.interpreter}"))
    cuda = bool(info.get("cuda_available"))
    if "triton" in info:
        rows.append(Check("triton", True, str(info["triton"])))
    else:
        needed = cuda or wants_gpus
        rows.append(
            Check(
                "triton",
                not needed,
                "not installed" + ("" if needed else " (not needed without CUDA)"),
                "install the triton that matches torch" if needed else "",
            )
        )
    rows.append(_packages_check(host, info.get("packages")))
    rows.append(_cuda_check(host, info, cuda))
    rows.append(_smi_check(host, info.get("nvidia_smi")))
    return rows


PIP_NAMES = {"yaml": "pyyaml"}


def _packages_check(host: HostSpec, packages: dict[str, Any] | None) -> Check:
    """The trainer's other imports (numpy, safetensors, yaml); unknown when torch's probe failed."""
    if packages is None:
        return Check("trainer packages", False, "not checked (the torch probe failed)", "")
    missing = [name for name, version in packages.items() if version is None]
    found = ", ".join(f"{name} {version}" for name, version in packages.items() if version is not None)
    if missing:
        wanted = " ".join(PIP_NAMES.get(name, name) for name in missing)
        return Check(
            "trainer packages",
            False,
            f"missing: {', '.join(missing)}" + (f" (have {found})" if found else ""),
            f"{host.interpreter} -m pip install {wanted}",
        )
    return Check("trainer packages", True, found)


def _cuda_check(host: HostSpec, info: dict[str, Any], cuda: bool) -> Check:
    count = int(info.get("gpu_count") or 0)
    if not cuda:
        if host.gpus:
            return Check(
                "cuda",
                False,
                "CUDA not available to torch",
                f"hosts.yaml lists gpus {list(host.gpus)}: check the driver and a CUDA build of torch",
            )
        return Check("cuda", True, "not available (CPU only; no gpus listed in hosts.yaml)")
    names = ", ".join(sorted(set(info.get("gpu_names") or [])))
    detail = f"CUDA {info.get('cuda_version')}, {count} GPU(s): {names}"
    missing = [g for g in host.gpus if g >= count]
    if missing:
        return Check("cuda", False, detail, f"hosts.yaml lists gpus {missing} that torch cannot see")
    return Check("cuda", True, detail)


def _smi_check(host: HostSpec, smi: dict[str, Any] | None) -> Check:
    if smi is None:
        if host.gpus:
            return Check(
                "nvidia-smi",
                False,
                "not found in the container",
                "install the NVIDIA userspace tools matching the host driver",
            )
        return Check("nvidia-smi", True, "not present (no gpus listed in hosts.yaml)")
    if "error" in smi:
        return Check("nvidia-smi", False, str(smi["error"]), "check the driver on the host")
    gpus = smi.get("gpus") or []
    listed = "; ".join(
        f"{g['index']}: {g['name']} {g['memory_used_mib']}/{g['memory_total_mib']} MiB {g['utilization_pct']}%"
        for g in gpus
    )
    return Check("nvidia-smi", True, f"{len(gpus)} GPU(s): {listed}" if gpus else "no GPUs")


LONG_DETAIL = 60  # characters: a longer detail of a failing check goes below the table, whole


def _cells(check: Check) -> tuple[str, list[tuple[str, str, str]]]:
    """A check's detail cell, and what goes below the table for it (long details, hints)."""
    below = not check.ok and (len(check.detail) > LONG_DETAIL or bool(check.hint))
    if not below:
        return check.detail, []
    return ("see below" if len(check.detail) > LONG_DETAIL else check.detail), [(check.name, check.detail, check.hint)]


def render_checks(checks: list[Check], json_out: bool) -> None:
    """Print checks as a table (or one JSON object with --json) on stdout; a failing check's long
    detail and its hint are printed below the table, so they read whole at any width."""
    if json_out:
        print(json.dumps({"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}, indent=2))
        return
    rows, below = [], []
    for check in checks:
        cell, extra = _cells(check)
        rows.append([check.name, _status(check), cell])
        below += extra
    console = Console(highlight=False)
    show(console, [Column("check"), Column("status"), Column("detail", text=True)], rows)
    notes(console, below)


def render_many(results: dict[str, list[Check]], json_out: bool) -> None:
    """Several hosts' checks as one table with a host column and a summary line (or one JSON object)."""
    ok = {name: all(c.ok for c in checks) for name, checks in results.items()}
    if json_out:
        hosts = [
            {"host": name, "ok": ok[name], "checks": [asdict(c) for c in checks]} for name, checks in results.items()
        ]
        print(json.dumps({"ok": all(ok.values()), "hosts": hosts}, indent=2))
        return
    rows, sections, below = [], [], []
    for name, checks in results.items():
        sections.append(len(rows))
        for check in checks:
            cell, extra = _cells(check)
            rows.append([name, check.name, _status(check), cell])
            below += [(f"{name} {label}", detail, hint) for label, detail, hint in extra]
    console = Console(highlight=False)
    show(
        console,
        [Column("host"), Column("check"), Column("status"), Column("detail", text=True)],
        rows,
        sections=sections[1:],
    )
    notes(console, below)
    failed = [name for name, good in ok.items() if not good]
    summary = f"{len(ok) - len(failed)} of {len(ok)} hosts ok" + (f"; failing: {', '.join(failed)}" if failed else "")
    console.print(Text(summary, style="bold red" if failed else "green"))


def _status(check: Check) -> Text:
    return Text("ok", style="green") if check.ok else Text("FAIL", style="bold red")
