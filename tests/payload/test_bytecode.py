"""bytecode.keep_bytecode: where a package installed without compiled bytecode gets it from."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.bytecode import keep_bytecode

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


def a_package(root: Path, compiled: bool) -> Path:
    """`fakepkg` under root, with or without its bytecode beside the source."""
    pkg = root / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 41 + 1\n")
    if compiled:
        import py_compile

        py_compile.compile(str(pkg / "__init__.py"), doraise=True)
    return root


@pytest.fixture
def python_state(monkeypatch):
    """This process's bytecode settings, restored after the test (keep_bytecode changes them)."""
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")


def test_nothing_is_decided_without_a_directory_or_where_bytecode_exists(tmp_path, monkeypatch, python_state):
    monkeypatch.syspath_prepend(str(a_package(tmp_path / "site", compiled=True)))
    assert keep_bytecode(None, "fakepkg") is None
    assert keep_bytecode(str(tmp_path / "cache"), "fakepkg") is None  # compiled at install
    assert keep_bytecode(str(tmp_path / "cache"), "no_such_package_here") is None
    assert sys.pycache_prefix is None and sys.dont_write_bytecode
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1" and not (tmp_path / "cache").exists()


def test_a_package_without_bytecode_that_python_may_not_write_gets_the_cache(tmp_path, monkeypatch, python_state):
    monkeypatch.syspath_prepend(str(a_package(tmp_path / "site", compiled=False)))
    cache = tmp_path / "cache"
    line = keep_bytecode(str(cache), "fakepkg")
    assert line.startswith(f"bytecode cache: {cache} (cold: this start fills it; fakepkg was installed")
    assert "PYTHONDONTWRITEBYTECODE is set" in line
    assert sys.pycache_prefix == str(cache) and not sys.dont_write_bytecode
    # Children (compile workers, the warm-up process) start with the same choice.
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(cache) and "PYTHONDONTWRITEBYTECODE" not in os.environ


def test_a_prefix_from_the_environment_wins(tmp_path, monkeypatch, python_state):
    monkeypatch.syspath_prepend(str(a_package(tmp_path / "site", compiled=False)))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    line = keep_bytecode(str(tmp_path / "cache"), "fakepkg")
    assert line == f"bytecode: {tmp_path / 'theirs'} (PYTHONPYCACHEPREFIX from the environment)"
    assert sys.pycache_prefix == str(tmp_path / "theirs") and not (tmp_path / "cache").exists()


def test_the_second_start_reads_what_the_first_wrote(tmp_path):
    """Real interpreters, as the trainer starts: PYTHONDONTWRITEBYTECODE set, no bytecode installed."""
    site, cache = a_package(tmp_path / "site", compiled=False), tmp_path / "cache"
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
        "from dflash_train.bytecode import keep_bytecode; print(keep_bytecode(sys.argv[3], 'fakepkg')); "
        "import fakepkg; print(fakepkg.__cached__, fakepkg.VALUE)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"

    def start() -> list[str]:
        argv = [sys.executable, "-c", code, str(PAYLOAD), str(site), str(cache)]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.splitlines()

    first, second = start(), start()
    assert "(cold: this start fills it;" in first[0] and "(warm: kept from earlier starts;" in second[0]
    cached, value = second[1].split()
    assert value == "42" and Path(cached).is_file() and Path(cached).is_relative_to(cache)
    assert not list((site / "fakepkg").rglob("*.pyc"))  # nothing written beside the source
