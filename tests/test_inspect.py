"""`dflashctl inspect`: exact source lines, symbols, grep, --path, cache, live config, errors.

Exactness is checked against `inspect.getsource` computed in ONE separate Python process with the
same torch (the `reference` fixture). Source reads never import torch, so they are fast; the live
config forms import it remotely, and only twice in this file: a listing on `local` (where the
test controls the remote process's environment through the CLI subprocess's env; the shim
container gets the SSH session's environment, which sshd does not take from the client) and one
key through the shim.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflashctl.containers import Target
from dflashctl.errors import ContainerError, NotFoundError, UsageError
from dflashctl.introspect import (
    InspectOptions,
    LineRange,
    SourceCache,
    cache_root,
    expand_alias,
    parse_lines,
    read_source,
    run_inspect,
    select_config,
    source_lines,
)
from dflashctl.transport import Process, Transport
from sshd import CLI

HOSTS = ["local", "shim"]
MODULES = {  # module -> line ranges to read
    "torch._inductor.compile_fx": ["1825:1888", "1:40"],
    "torch._inductor.cudagraph_trees": ["300:420"],
    "torch._dynamo.eval_frame": ["1:+30"],
    "torch._inductor.config": ["1800:1830"],
}
SYMBOLS = [
    "torch._inductor.compile_fx.cudagraphify",
    "torch._inductor.cudagraph_trees.get_obj",
    "torch._inductor.cudagraph_trees.CUDAGraphTreeManager.run",  # nested method
    "torch._dynamo.eval_frame.OptimizeContext",  # a class
]

# Files whose splitlines() numbering differs from the file's "\n" lines, or that need decoding.
EDGY_LATIN1 = (
    b"# -*- coding: latin-1 -*-\r\n"
    b'"""caf\xe9 with CRLF endings"""\r\n'
    b"x = 1\x0c\r\n"
    b"\x0c\r\n"
    b"def f():\r\n"
    b"    return 'caf\xe9'\r\n"
    b"y = 2"  # no trailing newline
)
EDGY_UTF8 = textwrap.dedent(
    """\
    # separators: \x1c file \x1d group \x1e record \x85 nel \u2028 line \u2029 para \x0b vt
    import functools


    @functools.lru_cache(None)
    def g(a):
        # body comment
        return a  # \u2028 still the same line for Python
        # trailing comment kept by inspect


    class K:
        class Inner:
            def m(self):
                return 1
    """
).encode("utf-8")


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edgy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with modules full of line-break oddities, to be put on PYTHONPATH."""
    root = tmp_path_factory.mktemp("edgy")
    (root / "edgy_latin1.py").write_bytes(EDGY_LATIN1)
    (root / "edgy_utf8.py").write_bytes(EDGY_UTF8)
    return root


REFERENCE_SCRIPT = textwrap.dedent(
    """
    import importlib, inspect, json, sys
    modules, symbols = json.loads(sys.argv[1])
    out = {"modules": {}, "symbols": {}}
    for name in modules:
        out["modules"][name] = inspect.getsource(importlib.import_module(name)).splitlines()
    for dotted in symbols:
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        out["symbols"][dotted] = inspect.getsource(inspect.unwrap(obj)).splitlines()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module", autouse=True)
def torch_jobs(sshd_host, edgy_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The three processes that import torch, started together because they dominate this file's time.

    reference: getsource(module/symbol).splitlines() in a separate process with the same torch.
    config: `inspect inductor.config --json` on `local`, with two TORCHINDUCTOR_ variables set for the
      remote process (on `local` it inherits the CLI's environment).
    single: `inspect inductor.config.triton.cudagraph_trees` through sshd + pct shim.
    """
    symbols = SYMBOLS + ["edgy_latin1.f", "edgy_utf8.g", "edgy_utf8.K.Inner.m"]
    modules = list(MODULES) + ["edgy_latin1", "edgy_utf8"]
    cache = str(tmp_path_factory.mktemp("torch-jobs-cache"))
    config_env = {"TORCHINDUCTOR_CUDAGRAPHS": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    argv = {
        "reference": ([sys.executable, "-c", REFERENCE_SCRIPT, json.dumps([modules, symbols])],
                      {"PYTHONPATH": str(edgy_dir), "PATH": "/usr/bin:/bin"}),
        "config": ([*CLI, "inspect", "-H", "local", "inductor.config", "--json"],
                   {**sshd_host.env, **config_env, "XDG_CACHE_HOME": cache}),
        "single": ([*CLI, "inspect", "inductor.config.triton.cudagraph_trees"],
                   {**sshd_host.env, "XDG_CACHE_HOME": cache}),
    }  # fmt: skip
    jobs = {
        name: subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        for name, (cmd, env) in argv.items()
    }
    yield {name: _Job(proc) for name, proc in jobs.items()}
    for proc in jobs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


class _Job:
    """A started process whose outcome is collected on first use."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.outcome: tuple[int, str, str] | None = None

    def result(self) -> tuple[int, str, str]:
        """(exit code, stdout, stderr), waiting for the process if needed."""
        if self.outcome is None:
            out, err = self.proc.communicate(timeout=600)
            self.outcome = (self.proc.returncode, out, err)
        return self.outcome


@pytest.fixture(scope="module")
def reference(torch_jobs) -> dict:  # type: ignore[no-untyped-def]
    code, out, err = torch_jobs["reference"].result()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private client cache for in-process reads (XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def session(sshd_host, cache_home):  # type: ignore[no-untyped-def]
    with sshd_host.session() as s:
        yield s


def inspect_text(session, host: str, **options) -> str:  # type: ignore[no-untyped-def]
    """Plain-mode output of one in-process inspect call."""
    chunks: list[str] = []
    run_inspect(session.target(host), InspectOptions(**options), chunks.append)
    return "".join(chunks)


def numbered(lines: list[str], first: int, last: int) -> str:
    return "".join(f"{n}: {lines[n - 1]}\n" for n in range(first, last + 1))


# --- cache ------------------------------------------------------------------------------------


class _Counting(Process):
    """A Process whose stdout counts the bytes it hands out."""

    def __init__(self, inner: Process, counter: list[int]):
        self._inner, self._counter = inner, counter
        self.stdin, self.stderr = inner.stdin, inner.stderr
        self.stdout = self  # type: ignore[assignment]

    def read1(self, n: int = -1) -> bytes:
        chunk = self._inner.stdout.read1(n)
        self._counter[0] += len(chunk)
        return chunk

    def wait(self, timeout: float | None = None) -> int:
        return self._inner.wait(timeout)

    def kill(self) -> None:
        self._inner.kill()


class Recording(Transport):
    """Wraps the real transport: counts commands started and stdout bytes received."""

    def __init__(self, inner: Transport):
        self.inner, self.name = inner, inner.name
        self.commands: list[list[str]] = []
        self.received = [0]

    def start(self, argv, env=None):  # type: ignore[no-untyped-def]
        self.commands.append(list(argv))
        return _Counting(self.inner.start(argv, env=env), self.received)


def test_warm_read_moves_no_file_content(session):
    host = session.host("shim")
    recording = Recording(session.transport(host))
    target = Target(host, recording)
    cache = SourceCache(cache_root(), host)
    cold = read_source(target, "torch._inductor.compile_fx", cache, lines=LineRange(1825, 1888))
    file_size = Path(cold.file).stat().st_size
    assert not cold.cache_hit and cold.received == file_size and recording.received[0] > file_size
    recording.commands.clear()
    recording.received[0] = 0
    warm = read_source(target, "torch._inductor.compile_fx.cudagraphify", cache)
    assert warm.cache_hit and warm.received == 0
    assert len(recording.commands) == 1 and recording.received[0] < 2000  # the header line only
    # The one remote command is a bare interpreter running our script: no torch import in it.
    assert "import torch" not in recording.commands[0][-2]


def test_cache_json_flag_and_changed_file(tmp_path, monkeypatch, cache_home):
    """On `local` (its remote process inherits PYTHONPATH): the second read is a hit in the JSON;
    editing the file makes the next read send it again."""
    module = tmp_path / "lib" / "mymod.py"
    module.parent.mkdir()
    module.write_text("a = 1\nb = 2\n")
    monkeypatch.setenv("PYTHONPATH", str(module.parent))
    target = _local_target()

    def read() -> dict:
        chunks: list[str] = []
        run_inspect(target, InspectOptions("mymod", json=True), chunks.append)
        return json.loads("".join(chunks))

    assert read()["cache"] == {"hit": False, "content_bytes_received": 12}
    assert read()["cache"] == {"hit": True, "content_bytes_received": 0}
    assert list((cache_home / "dflashctl" / "inspect" / "local" / "host" / "blobs").iterdir())
    module.write_text("a = 1\nb = 3\n")
    third = read()
    assert third["cache"]["hit"] is False and third["lines"][1]["text"] == "b = 3"


def _local_target() -> Target:
    from dflashctl.inventory import builtin_local
    from dflashctl.transport import LocalTransport

    return Target(builtin_local(), LocalTransport())


# --- live config ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_config(torch_jobs) -> dict:  # type: ignore[no-untyped-def]
    code, out, err = torch_jobs["config"].result()
    assert code == 0, err
    return json.loads(out)


def test_config_listing_flattens_and_marks_env(local_config):
    entries = {e["key"]: e for e in local_config["entries"]}
    assert entries["triton.cudagraph_trees"]["value"] is True
    assert entries["triton.cudagraph_trees"]["env_set"] == {}
    graphs = entries["triton.cudagraphs"]  # plain `os.environ.get(...) == "1"` assignment
    assert (graphs["value"], graphs["default"], graphs["env_set"]) == (True, False, {"TORCHINDUCTOR_CUDAGRAPHS": "1"})
    cache = entries["fx_graph_cache"]  # Config(env_name_force=...)
    assert cache["value"] is False and cache["env_set"] == {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE" in cache["env_vars"]


def test_config_grep_and_subtree(local_config):
    import re

    entries = local_config["entries"]
    grepped, single = select_config(entries, "", re.compile("cudagraph_tree"))
    assert not single and {e["key"] for e in grepped} >= {"triton.cudagraph_trees"}
    assert all("cudagraph_tree" in e["key"] for e in grepped)
    subtree, single = select_config(entries, "triton", None)
    assert not single and subtree and all(e["key"].startswith("triton.") for e in subtree)
    one, single = select_config(entries, "triton.cudagraph_trees", None)
    assert single and one[0]["key"] == "triton.cudagraph_trees"


def test_config_single_key_through_shim(torch_jobs):
    assert torch_jobs["single"].result() == (0, "True\n", "")


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, message",
    [
        ("compile_fxx", "module not found: compile_fxx (did you mean compile_fx?)"),
        (
            "torch._inductor.compile_fxx",
            "module not found: torch._inductor.compile_fxx (did you mean torch._inductor.compile_fx",
        ),
        ("compile_fx.cudagraphifyy", "symbol not found: cudagraphifyy in torch._inductor.compile_fx"),
        ("cudagraph_trees.CUDAGraphTreeManager.runn", "symbol not found: CUDAGraphTreeManager.runn"),
        ("torch._C", "no Python source for torch._C: it is a compiled extension"),
    ],
)
def test_not_found_errors(session, target, message):
    with pytest.raises(NotFoundError) as err:
        inspect_text(session, "shim", target=target)
    assert str(err.value).startswith(message)


def test_line_range_outside_file_says_how_many_lines(session, reference):
    total = len(reference["modules"]["torch._inductor.compile_fx"])
    with pytest.raises(UsageError, match=rf"outside .*compile_fx.py, which has {total} lines"):
        inspect_text(session, "shim", target="compile_fx", lines=f"{total + 1}:{total + 5}")


def test_unusable_host_or_container_errors(sshd_host, tmp_path, cache_home):
    from dflashctl.errors import ConnectError

    closed = {"transport": "ssh", "address": "127.0.0.1", "port": _closed_port(), "user": sshd_host.user}
    extra = {"gone": closed, "notorch": sshd_host.host_entry(200, python="/usr/bin/python3")}
    inventory = sshd_host.write_inventory(tmp_path / "hosts.yaml", extra)
    cases = [("stopped", ContainerError, "container 201 is not running"), ("gone", ConnectError, "")]
    if Path("/usr/bin/python3").exists():  # the system python has no torch
        cases.append(("notorch", ContainerError, "torch is not installed for /usr/bin/python3"))
    with sshd_host.session(inventory=inventory) as session:
        for host, error, text in cases:
            with pytest.raises(error) as err:
                inspect_text(session, host, target="compile_fx")
            assert text in str(err.value)
            if host == "notorch":
                with pytest.raises(ContainerError, match="torch is not installed"):
                    inspect_text(session, host, target="inductor.config")


def test_cli_errors_are_one_line_with_exit_codes(sshd_host, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    for args, code, text in [(["compile_fx", "-H", "stopped"], 4, "container 201 is not running"),
                             (["compile_fxx", "--lines", "3"], 5, "did you mean compile_fx?")]:  # fmt: skip
        out = sshd_host.run_cli("inspect", *args, env=env)
        assert out.returncode == code, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and text in out.stderr, out.stderr


def test_ctrl_c_of_a_config_read_stops_its_torch_import_on_the_host(sshd_host, tmp_path):
    """`inspect inductor.config` imports torch in the container (seconds, more when cold); a Ctrl-C
    over SSH closed the channel and left that import running there. A torch whose import hangs
    stands in for a slow one; it must be gone when the CLI has exited."""
    import os
    import shlex
    import signal

    from runs_helpers import alive, wait_until
    from sshd import SHIM_VMID

    fake, started = tmp_path / "fake", tmp_path / "importing"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        f"import os, time\nopen({str(started)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(fake))} exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    slow = sshd_host.host_entry(SHIM_VMID, python=str(python))
    env = {
        **sshd_host.env,
        "DFLASHCTL_INVENTORY": str(sshd_host.write_inventory(tmp_path / "hosts.yaml", {"slow": slow})),
        "XDG_CACHE_HOME": str(tmp_path),
    }
    proc = subprocess.Popen(
        [*CLI, "inspect", "inductor.config", "-H", "slow"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pid = 0
    try:
        pid = int(wait_until(lambda: started.exists() and started.read_text(), 60, "the remote torch import"))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err) == (130, b"error: interrupted\n")
        assert not alive(pid)
    finally:
        proc.kill()
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- parsing ----------------------------------------------------------------------------------


def test_parse_lines_forms():
    assert parse_lines("1825:1888") == LineRange(1825, 1888)
    assert parse_lines("1850:+20") == LineRange(1850, 1870)
    assert parse_lines("1850", context=3) == LineRange(1847, 1853)
    assert parse_lines("2", context=5) == LineRange(1, 7)
    assert parse_lines("10:") == LineRange(10, None)
    for bad in ("0:3", "5:2", "a", "1:2:3"):
        with pytest.raises(UsageError):
            parse_lines(bad)


@pytest.mark.parametrize(
    "options,message",
    [({"target": " "}, "TARGET is empty"), ({"target": "compile_fx", "context": -1}, "--context must be 0 or more")],
)
def test_bad_options_fail_before_any_remote_call(options, message):
    with pytest.raises(UsageError, match=message):
        run_inspect(None, InspectOptions(**options), print)  # type: ignore[arg-type]  # no target: never reached


def test_aliases():
    assert expand_alias("compile_fx") == "torch._inductor.compile_fx"
    assert expand_alias("compile_fx.cudagraphify") == "torch._inductor.compile_fx.cudagraphify"
    assert expand_alias("inductor.config.triton.cudagraph_trees") == "torch._inductor.config.triton.cudagraph_trees"
    assert expand_alias("dynamo.config") == "torch._dynamo.config"
    assert expand_alias("torch._inductor.utils") == "torch._inductor.utils"
    assert expand_alias("inductorx") == "inductorx"


# --- grep, --path, json -----------------------------------------------------------------------


def test_grep_bounded_by_lines_with_context(session, reference):
    lines = reference["modules"]["torch._inductor.compile_fx"]
    hits = [n for n in range(1800, 1906) if "cudagraph_trees" in lines[n - 1]]
    assert hits, "compile_fx should mention cudagraph_trees in 1800-1905"
    out = inspect_text(session, "shim", target="compile_fx", lines="1800:1905", grep="cudagraph_trees")
    assert out == "".join(f"{n}: {lines[n - 1]}\n" for n in hits)
    with_context = inspect_text(
        session, "shim", target="compile_fx", lines="1800:1905", grep="cudagraph_trees", context=1
    )
    first = with_context.splitlines()[0]
    assert first == f"{hits[0] - 1}- {lines[hits[0] - 2]}"


def test_grep_without_a_match_is_not_found(session):
    with pytest.raises(
        NotFoundError,
        match=r"^--grep 'no_such_word_xyz': no match in torch\._inductor\.compile_fx "
        r"\(/.*compile_fx\.py\), lines 1:40$",
    ):
        inspect_text(session, "shim", target="compile_fx", lines="1:40", grep="no_such_word_xyz")
    with pytest.raises(NotFoundError, match=r"^--grep 'no_such_key_xyz': no key of torch\._inductor\.config matches$"):
        inspect_text(session, "shim", target="inductor.config", grep="no_such_key_xyz")


def test_path_and_json(session, reference):
    out = inspect_text(session, "shim", target="cudagraph_trees", path=True)
    path, version = out.splitlines()
    assert path.endswith("torch/_inductor/cudagraph_trees.py") and Path(path).is_file()
    import importlib.metadata

    assert version == f"torch {importlib.metadata.version('torch')}"
    sym = json.loads(inspect_text(session, "shim", target="compile_fx.cudagraphify", path=True, json=True))
    assert sym["module"] == "torch._inductor.compile_fx" and sym["symbol"] == "cudagraphify" and len(sym["span"]) == 2
    data = json.loads(inspect_text(session, "shim", target="compile_fx", lines="1825:1830", json=True))
    expected = reference["modules"]["torch._inductor.compile_fx"]
    assert [(e["n"], e["text"]) for e in data["lines"]] == [(n, expected[n - 1]) for n in range(1825, 1831)]
    assert data["total_lines"] == len(expected) and data["version"] == version.split()[1]


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
def test_module_ranges_match_inspect_byte_for_byte(session, reference, host):
    for module, ranges in MODULES.items():
        expected_lines = reference["modules"][module]
        for spec in ranges:
            rng = parse_lines(spec)
            last = min(rng.end, len(expected_lines))
            out = inspect_text(session, host, target=module, lines=spec, source=True)
            assert out.encode() == numbered(expected_lines, rng.start, last).encode(), (host, module, spec)


@pytest.mark.parametrize("host", HOSTS)
def test_symbols_print_definition_with_true_numbers(session, reference, host):
    for dotted in SYMBOLS:
        module = dotted.rsplit(".", 2)[0] if "CUDAGraphTreeManager" in dotted else dotted.rsplit(".", 1)[0]
        module_lines = reference["modules"][module]
        view = read_source(session.target(host), dotted, SourceCache(cache_root(), session.host(host)))
        assert [t for _, t in view.lines] == reference["symbols"][dotted], dotted
        assert all(module_lines[n - 1] == t for n, t in view.lines), dotted
        assert view.span == (view.lines[0][0], view.lines[-1][0])


def test_compile_fx_alias_over_the_cli_is_exact(sshd_host, reference, tmp_path):
    """The issue's own command, end to end through real sshd + pct shim, bytes on stdout."""
    out = sshd_host.run_cli("inspect", "compile_fx", "--lines", "1825:1888", binary=True,
                            env={"XDG_CACHE_HOME": str(tmp_path)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == numbered(reference["modules"]["torch._inductor.compile_fx"], 1825, 1888).encode()


def test_line_break_oddities_match_inspect(edgy_dir, reference, monkeypatch, cache_home):
    """CRLF, form feeds, \\x1c-\\x1e, \\x85, \\u2028/9, \\v, latin-1 cookie, no final newline: as inspect numbers
    them."""
    monkeypatch.setenv("PYTHONPATH", str(edgy_dir))
    target = _local_target()
    cache = SourceCache(cache_root(), target.host)
    for module in ("edgy_latin1", "edgy_utf8"):
        expected = reference["modules"][module]
        view = read_source(target, module, cache)
        assert view.lines == list(enumerate(expected, 1))
        chunks: list[str] = []
        run_inspect(target, InspectOptions(module, lines=f"2:{len(expected)}"), chunks.append)
        assert "".join(chunks) == numbered(expected, 2, len(expected))
    for dotted in ("edgy_latin1.f", "edgy_utf8.g", "edgy_utf8.K.Inner.m"):
        view = read_source(target, dotted, cache)
        module_lines = reference["modules"][dotted.split(".")[0]]
        assert [t for _, t in view.lines] == reference["symbols"][dotted], dotted
        assert all(module_lines[n - 1] == t for n, t in view.lines), dotted
    # splitlines() finds 7 extra breaks on line 1 (\x1c \x1d \x1e \x85 \u2028 \u2029 \v): g starts at 5 + 7.
    assert read_source(target, "edgy_utf8.g", cache).span[0] == 12


def test_source_lines_is_getsource_splitlines():
    assert source_lines(b"a\r\nb\rc\x0cd") == ["a", "b", "c", "d"]
    assert source_lines("\ufeffx = '\u2028'\n".encode("utf-8")) == ["x = '", "'"]


def test_terminal_rendering_is_highlighted_source_and_table(cache_home):
    from rich.console import Console

    console = Console(force_terminal=True, width=160, color_system="truecolor", record=True)
    run_inspect(
        _local_target(), InspectOptions("compile_fx.cudagraphify", grep="cudagraph_trees"), print, pretty=console
    )
    text = console.export_text(clear=False)
    assert "compile_fx.py  cudagraphify" in text and "config.triton.cudagraph_trees" in text
    assert "\x1b[" in console.export_text(styles=True)  # colours reach the terminal


def test_venv_interpreter_reads_its_own_site_packages(tmp_path, cache_home, monkeypatch):
    """Under `python -S` a venv's interpreter starts with the base prefix; the source lookup must
    still search the venv's site-packages, and not the user site the venv excludes. The same
    package in both places tells which one was read."""
    from dflashctl.inventory import HostSpec
    from dflashctl.transport import LocalTransport

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path / "userbase"))
    where = json.loads(
        subprocess.check_output(
            [
                python,
                "-c",
                "import json, site, sysconfig; print(json.dumps([sysconfig.get_paths()['purelib'], "
                "site.getusersitepackages()]))",
            ],
            text=True,
        )
    )
    for directory, label in zip(where, ("venv", "user site")):
        package = Path(directory) / "shadowpkg"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"WHERE = {label!r}\n")
    target = Target(HostSpec(name="venv", transport="local", python=python), LocalTransport())
    chunks: list[str] = []
    run_inspect(target, InspectOptions("shadowpkg", lines="1:1"), chunks.append)
    assert "".join(chunks) == "1: WHERE = 'venv'\n"


def test_package_found_only_through_a_pth_file(sshd_host, tmp_path):
    """Source reads run with `python -S`; a package that only a .pth file puts on sys.path (here
    dflashctl itself, installed editable) is still found through the full site set-up."""
    result = sshd_host.run_cli("inspect", "dflashctl.errors", "--lines", "1:2", "-H", "local", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = (Path(__file__).resolve().parent.parent / "dflashctl" / "errors.py").read_text().splitlines()[:2]
    assert result.stdout.splitlines() == [f"{n}: {line}" for n, line in enumerate(expected, 1)]


def test_the_cli_highlights_on_a_terminal_and_prints_the_exact_lines_in_a_pipe(shim_host, reference):
    """Whether to draw is the CLI's stdout being a terminal (a pipe never loads rich: start-up)."""
    import os
    import pty

    args = ["inspect", "compile_fx", "--lines", "1825:1830", "--host", "local"]
    piped = shim_host.run_cli(*args, process=True)
    lines = reference["modules"]["torch._inductor.compile_fx"]
    assert piped.returncode == 0 and piped.stdout == numbered(lines, 1825, 1830)
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, *args], stdin=subprocess.DEVNULL, stdout=secondary, stderr=subprocess.PIPE, env=shim_host.env
    )
    os.close(secondary)
    drawn = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the CLI closed the terminal's other end
            break
        if not chunk:
            break
        drawn += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc.stderr.close()
    text = drawn.decode()
    assert "compile_fx.py" in text and "1825" in text  # a titled panel with line numbers
    assert text.splitlines() != piped.stdout.splitlines()
