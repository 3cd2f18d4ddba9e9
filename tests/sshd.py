"""Test harness: a real OpenSSH sshd on a loopback address, a client HOME that trusts it, and the pct and docker shims.

Used by conftest.py; see its docstring for the fixture API.
"""

from __future__ import annotations

import getpass
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"
SHIM = Path(__file__).parent / "shims" / "pct"
DOCKER_SHIM = Path(__file__).parent / "shims" / "docker"
SHIM_VMID = 200
STOPPED_VMID = 201
DOCKER_NAME = "trainer"  # the `dock` host's docker container (running)
DOCKER_STOPPED = "halted"  # the `dockstop` host's (exited)
CLI = [sys.executable, "-c", "from dflashctl.cli import main; main()"]
MB = 1024 * 1024
# Copies stdin to stdout and stderr as it reads: all three streams are busy at once, so a pump
# that blocks on one of them (or a writer that waits for all input first) deadlocks the test.
ECHO_BOTH = """
import sys
src, out, err = sys.stdin.buffer, sys.stdout.buffer, sys.stderr.buffer
while chunk := src.read1(1 << 16):
    out.write(chunk)
    err.write(chunk)
out.flush(); err.flush()
"""


def run_concurrently(target, count: int = 8) -> list:  # type: ignore[no-untyped-def]
    """Run `count` overlapping commands on one Target from threads (command i sleeps, echoes i,
    exits i); returns their Completed results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: target.run(["sh", "-c", f"sleep 0.3; echo {i}; exit {i}"]), range(count)))


def run_together(target, count: int, meeting: Path) -> list:  # type: ignore[no-untyped-def]
    """Run `count` commands on one Target from threads that are all running at the same moment:
    command i leaves a mark in the (local, empty) directory `meeting`, waits until all `count`
    marks are there (at most ~120 s, else exit 99), echoes i and exits 0. Returns their Completed
    results in order. Unlike run_concurrently, overlap does not depend on timing."""
    from concurrent.futures import ThreadPoolExecutor

    wait = (f'touch "$1/$2"; n=0; while [ "$(ls "$1" | wc -l)" -lt {count} ]; do '
            'n=$((n+1)); [ $n -gt 2400 ] && exit 99; sleep 0.05; done; echo "$2"')  # fmt: skip
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: target.run(["sh", "-c", wait, "sh", str(meeting), str(i)]), range(count)))


def keygen(path: Path, comment: str) -> str:
    """Create an ed25519 key pair at path (no passphrase); return the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path.with_suffix(".pub").read_text().strip()


def free_port(address: str) -> int:
    """A port that is free on address right now."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# The stdin of every in-process call, never closed. `exec` forwards stdin from a thread that may
# first read it after main() has returned (a command that ended at once, on a busy machine): had the
# file been closed by then, its fd number would name another test's pipe or socket, and the late
# read would steal that test's bytes (seen: `cat`'s piped input lost, reads of a directory).
_IN_PROCESS_STDIN = open(os.devnull)


def run_main_in_process(args: tuple[str, ...], env: dict[str, str], cwd: Path | None) -> subprocess.CompletedProcess:
    """dflashctl's main() as a subprocess would run it: argv, os.environ = env, cwd, stdin from /dev/null
    and captured stdout/stderr (no terminal), all restored after; text decoded as subprocess.run(text=True) does."""
    from dflashctl.cli import main

    out, err = io.BytesIO(), io.BytesIO()
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr, dict(os.environ), os.getcwd(), signal.getsignal(signal.SIGINT)
    code: object = None
    sys.argv, sys.stdin = ["dflashctl", *args], _IN_PROCESS_STDIN
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    os.environ.clear()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        main()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        texts = [io.TextIOWrapper(io.BytesIO(s.getvalue()), encoding="utf-8").read() for s in (out, err)]
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved[:4]
        os.environ.clear()
        os.environ.update(saved[4])
        os.chdir(saved[5])
        signal.signal(signal.SIGINT, saved[6])
    assert isinstance(code, int), f"main() ended without an exit code: {code!r}"
    return subprocess.CompletedProcess(["dflashctl", *args], code, texts[0], texts[1])


class SshdHost:
    """One sshd listening on address:port, a client HOME trusting it, pct shim containers, a hosts.yaml."""

    def __init__(self, base: Path, address: str, max_sessions: int = 64):
        self.base = base
        self.address = address
        self.max_sessions = max_sessions  # sessions sshd allows on one connection (OpenSSH's default: 10)
        self.port = 0
        self.user = getpass.getuser()
        self.home = base / "home"
        self.containers_root = base / "containers"
        self.pct_path = base / "bin" / "pct"
        self.docker_root = base / "docker-containers"
        self.docker_path = base / "bin" / "docker"
        self.inventory_path = base / "hosts.yaml"
        self.host_key = base / "etc" / "ssh_host_ed25519_key"
        self.log_path = base / "sshd.log"
        self.remote_home = base / "remote-home"
        self._proc: subprocess.Popen[bytes] | None = None

    # --- setup ---------------------------------------------------------------------------

    def start(self) -> "SshdHost":
        """Create keys, shim and inventory, then start sshd and wait until it answers."""
        (self.base / "etc").mkdir(parents=True)
        self.remote_home.mkdir()
        keygen(self.host_key, f"sshd@{self.address}")
        client_pub = self._make_client_key()
        (self.base / "etc" / "authorized_keys").write_text(client_pub + "\n")
        self._install_shim()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for _ in range(5):  # another process may grab the free port before sshd binds it
            self.port = free_port(self.address)
            if self._launch():
                break
        else:
            raise RuntimeError(f"sshd did not start: {self.log_path.read_text()}")
        self.write_known_hosts(self.home)
        self.write_inventory()
        self.reset()
        return self

    def _make_client_key(self) -> str:
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(parents=True, mode=0o700)
        return keygen(ssh_dir / "id_ed25519", f"client@{self.address}")

    def _install_shim(self) -> None:
        """Copy the shims to bin/pct and bin/docker; they find their containers in ../containers
        and ../docker-containers."""
        self.pct_path.parent.mkdir(parents=True)
        self.containers_root.mkdir()
        self.docker_root.mkdir()
        for source, path in ((SHIM, self.pct_path), (DOCKER_SHIM, self.docker_path)):
            shutil.copy2(source, path)
            path.chmod(0o755)

    def _config(self) -> str:
        etc = self.base / "etc"
        return "\n".join(
            [
                f"ListenAddress {self.address}:{self.port}",
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {etc / 'authorized_keys'}",
                "PidFile none",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowTcpForwarding yes",
                f"MaxSessions {self.max_sessions}",
                "MaxStartups 64",
                "LogLevel VERBOSE",
                # Debian's bash sources ~/.bashrc for every ssh command; a login HOME of our own
                # keeps the machine's (possibly slow, pyenv-style) rc files out of the tests.
                f"SetEnv HOME={self.remote_home}",
                "",
            ]
        )

    def _launch(self) -> bool:
        config = self.base / "etc" / "sshd_config"
        config.write_text(self._config())
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30  # a bound: sshd starts in well under 1 s when idle
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.address, self.port), timeout=1) as sock:
                    if sock.recv(64).startswith(b"SSH-"):
                        return True
            except OSError:
                time.sleep(0.05)
        self.stop()
        return False

    def stop(self) -> None:
        """Stop the listener and every connection it spawned."""
        if self._proc is None:
            return
        self.kill_connections()
        self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    # --- client side ---------------------------------------------------------------------

    def host_key_line(self) -> str:
        """This sshd's known_hosts entry: `[address]:port ssh-ed25519 AAAA...`."""
        kind, blob = self.host_key.with_suffix(".pub").read_text().split()[:2]
        return f"[{self.address}]:{self.port} {kind} {blob}"

    def write_known_hosts(self, home: Path, trusted: bool = True) -> Path:
        """(Re)write home/.ssh/known_hosts, trusting this sshd or (trusted=False) empty."""
        path = home / ".ssh" / "known_hosts"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(self.host_key_line() + "\n" if trusted else "")
        return path

    def make_home(self, where: Path, trusted: bool = True) -> Path:
        """A fresh client HOME at where with this host's client key; known_hosts trusts sshd unless trusted=False."""
        ssh_dir = where / ".ssh"
        ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in ("id_ed25519", "id_ed25519.pub"):
            shutil.copy2(self.home / ".ssh" / name, ssh_dir / name)
        self.write_known_hosts(where, trusted)
        return where

    def link(self, other: "SshdHost") -> None:
        """Let this host's client HOME log in to `other` too (its key authorized there, its host key trusted here)."""
        client_pub = (self.home / ".ssh" / "id_ed25519.pub").read_text().strip()
        authorized = other.base / "etc" / "authorized_keys"
        if client_pub not in authorized.read_text():
            with authorized.open("a") as fh:
                fh.write(client_pub + "\n")
        known = self.home / ".ssh" / "known_hosts"
        if other.host_key_line() not in known.read_text():
            with known.open("a") as fh:
                fh.write(other.host_key_line() + "\n")

    def host_entry(self, vmid: int | None = None, **extra: object) -> dict:
        """A hosts.yaml entry for this sshd: container pct VMID, or runtime none when vmid is None."""
        # persist 0: tests connect directly unless they ask for the mux (tests/test_mux.py), so
        # that no background connection outlives a test; fork_server 0 likewise: no fork server
        # (a process importing torch, left for 30 minutes) unless a test asks for one
        # (tests/test_forkserver.py).
        entry: dict = {
            "transport": "ssh",
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "python": sys.executable,
            "persist": 0,
            "fork_server": 0,
        }
        if vmid is None:
            entry["container"] = {"runtime": "none"}
        else:
            entry["container"] = {"runtime": "pct", "vmid": vmid, "pct": str(self.pct_path)}
            entry["workdir"] = str(self.container_dir(vmid) / "work")
        entry.update(extra)
        return entry

    def docker_entry(self, name: str, **extra: object) -> dict:
        """A hosts.yaml entry for this sshd with the docker shim's container `name`."""
        entry: dict = {
            "transport": "ssh",
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "python": sys.executable,
            "persist": 0,
            "fork_server": 0,
            "workdir": str(self.docker_dir(name) / "work"),
            "container": {"runtime": "docker", "name": name, "docker": str(self.docker_path)},
        }
        entry.update(extra)
        return entry

    def write_inventory(self, path: Path | None = None, extra_hosts: dict | None = None) -> Path:
        """Write a hosts.yaml with shim, stopped, bare (+ extra_hosts); default shim."""
        hosts = {
            "shim": self.host_entry(SHIM_VMID),
            "stopped": self.host_entry(STOPPED_VMID),
            "bare": self.host_entry(None),
            "dock": self.docker_entry(DOCKER_NAME),
            "dockstop": self.docker_entry(DOCKER_STOPPED),
            **(extra_hosts or {}),
        }
        path = path or self.inventory_path
        path.write_text(yaml.safe_dump({"default": "shim", "hosts": hosts}, sort_keys=False))
        return path

    @property
    def env(self) -> dict[str, str]:
        """Environment for running the CLI as a subprocess against this host."""
        env = {k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK", "DFLASHCTL_INVENTORY")}
        env.update(HOME=str(self.home), DFLASHCTL_INVENTORY=str(self.inventory_path), NO_COLOR="1", COLUMNS="200")
        return env

    def run_cli(
        self,
        *args: str,
        input: str | bytes | None = None,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        binary: bool = False,
        process: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run `dflashctl ARGS` with self.env (+ env overrides); text unless binary or bytes input.

        In this process through main() (a subprocess costs ~0.4 s of imports), unless process=True,
        stdin input or binary output asks for real pipes, or the caller is not the main thread (main()
        installs a SIGINT handler). timeout bounds the subprocess; pytest-timeout bounds the rest."""
        full_env = {**self.env, **(env or {})}
        if not (process or input is not None or binary or threading.current_thread() is not threading.main_thread()):
            return run_main_in_process(args, full_env, cwd)
        as_bytes = binary or isinstance(input, bytes)
        return subprocess.run(
            [*CLI, *args],
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            text=not as_bytes,
        )

    def session(self, home: Path | None = None, inventory: Path | None = None):  # type: ignore[no-untyped-def]
        """An in-process Session on the inventory, using home's ~/.ssh (no os.environ changes, no agent)."""
        from dflashctl.inventory import load_inventory
        from dflashctl.session import Session
        from dflashctl.ssh import SshOptions

        options = SshOptions(home=home or self.home, agent=False, attempts=2, backoff_s=0.2)
        return Session(load_inventory(inventory or self.inventory_path), ssh_options=options)

    # --- containers and connections ------------------------------------------------------

    def container_dir(self, vmid: int) -> Path:
        """The shim container's directory (its HOME and cwd)."""
        return self.containers_root / str(vmid)

    def add_container(self, vmid: int, running: bool = True) -> Path:
        """Create (or empty) container vmid and set its state; return its directory."""
        path = self.container_dir(vmid)
        shutil.rmtree(path, ignore_errors=True)
        (path / "work").mkdir(parents=True)
        self.set_running(vmid, running)
        return path

    def docker_dir(self, name: str) -> Path:
        """The docker shim container's directory (its HOME and default cwd)."""
        return self.docker_root / name

    def add_docker(self, name: str, running: bool = True) -> Path:
        """Create (or empty) docker shim container `name`, running or exited; return its directory."""
        path = self.docker_dir(name)
        shutil.rmtree(path, ignore_errors=True)
        (path / "work").mkdir(parents=True)
        (self.docker_root / f"{name}.state").write_text("running\n" if running else "exited\n")
        return path

    def set_running(self, vmid: int, running: bool) -> None:
        """Mark the shim container running or stopped."""
        status = "running" if running else "stopped"
        (self.containers_root / f"{vmid}.conf").write_text(f"hostname: ct{vmid}\nstatus: {status}\n")

    def reset(self) -> None:
        """Back to the initial state: only containers 200 (running, empty) and 201 (stopped), and
        docker containers `trainer` (running, empty) and `halted` (exited)."""
        for root in (self.containers_root, self.docker_root):
            for entry in root.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self.add_container(SHIM_VMID, True)
        self.add_container(STOPPED_VMID, False)
        self.add_docker(DOCKER_NAME, True)
        self.add_docker(DOCKER_STOPPED, False)

    def kill_connections(self) -> int:
        """SIGKILL every per-connection sshd process (the listener stays up); return how many."""
        if self._proc is None:
            return 0
        victims, todo = [], _children(self._proc.pid)
        while todo:
            pid = todo.pop()
            if _comm(pid) == "sshd":
                victims.append(pid)
                todo.extend(_children(pid))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(victims)


class CuttingRelay:
    """A loopback TCP relay to an sshd that drops a connection through it, both ways, once `after`
    bytes have gone from the client to the server: a connection lost at an exact point of a
    transfer, whatever the machine's speed (killing sshd when a watcher sees the transfer pass that
    point raced the transfer's end on a loaded machine)."""

    def __init__(self, server_port: int, after: int):
        self.server_port, self.after = server_port, after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.server_port))
            pair = (client, server)
            threading.Thread(target=self._pump, args=(client, server, True, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool, pair: tuple) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if upstream and sent + len(data) >= self.after:
                    self.cut.set()  # nothing past the point goes through
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def host_entry(self, host: "SshdHost", home: Path, vmid: int) -> dict:
        """A hosts.yaml entry for host's container vmid through this relay; home's known_hosts
        trusts host's key at the relay's port."""
        kind, blob = host.host_key.with_suffix(".pub").read_text().split()[:2]
        with (home / ".ssh" / "known_hosts").open("a") as fh:
            fh.write(f"[{host.address}]:{self.port} {kind} {blob}\n")
        return host.host_entry(vmid, port=self.port)

    def close(self) -> None:
        """Stop accepting (connections through it end with their ends)."""
        self.listener.close()
