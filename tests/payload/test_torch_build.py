"""torch_build: the installed torch and its GPU count without importing torch, and the
pre-flight that uses them."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train import torch_build
from dflash_train.config import ConfigError
from dflash_train.plan import parse_device
from dflash_train.torch_build import TorchBuild, read_build

PAYLOAD = Path(__file__).resolve().parents[2] / "remote_payload"


def test_the_installed_build_is_what_torch_says():
    build = torch_build.installed()
    assert build == TorchBuild(torch.__version__, torch.version.cuda, torch.version.hip)


def test_version_py_files_of_each_kind(tmp_path):
    file = tmp_path / "version.py"
    file.write_text(
        "from typing import Optional\n__all__ = ['__version__', 'cuda']\n__version__ = '2.11.0+cu130'\n"
        "debug = False\ncuda: Optional[str] = '13.0'\ngit_version = 'abc'\nhip: Optional[str] = None\n"
    )
    assert read_build(file) == TorchBuild("2.11.0+cu130", "13.0", None)
    file.write_text("__version__ = '2.13.0+cpu'\ncuda = None\nhip = None\n")
    assert read_build(file) == TorchBuild("2.13.0+cpu", None, None)


@pytest.mark.parametrize(
    "build,driver,expected",
    [
        (TorchBuild("2.13.0+cpu", None, None), 8, 0),  # a CPU build sees no GPU, whatever the box has
        (TorchBuild("2.11.0+cu130", "13.0", None), 2, 2),  # a CUDA build: the driver's count
        (TorchBuild("2.11.0+cu130", "13.0", None), 0, 0),
    ],
)
def test_the_gpu_count_rule(monkeypatch, build, driver, expected):
    monkeypatch.setattr(torch_build, "installed", lambda: build)
    monkeypatch.setattr(torch_build, "driver_gpu_count", lambda: driver)
    assert torch_build.visible_gpus() == expected


def test_without_a_driver_library_torch_answers(monkeypatch):
    monkeypatch.setattr(torch_build, "installed", lambda: TorchBuild("2.11.0+cu130", "13.0", None))
    monkeypatch.setattr(torch_build, "driver_gpu_count", lambda: None)
    assert torch_build.visible_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:3", "cpu:0"])
def test_devices_are_read_as_torch_reads_them(text):
    device = torch.device(text)
    assert parse_device(text) == (device.type, device.index)


@pytest.mark.parametrize(
    "text,message",
    [
        ("cuda:", "is not a device"),
        ("cuda:x", "is not a device"),
        ("gpu 0", "is not a device"),
        ("cuda:-1", "is not a device"),
        ("mps", "the trainer runs on cpu or cuda"),
        ("meta:0", "the trainer runs on cpu or cuda"),
    ],
)
def test_other_devices_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_device(text)


def test_the_preflight_does_not_import_torch():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from dflash_train.__main__ import main; "
        "code = main(['--preflight', '--set', 'run.device=cpu']); print('torch' in sys.modules, code)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(PAYLOAD)], capture_output=True, text=True, check=True)
    answer, last = out.stdout.splitlines()
    assert '"ok": true' in answer and last == "False 0"


def test_the_regen_preflight_does_not_import_torch(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from dflash_train.regen import main; "
        "code = main(['--prompts', sys.argv[2], '--out', sys.argv[3], '--gpus', 'cpu', '--preflight']); "
        "print('torch' in sys.modules, code)"
    )
    argv = [sys.executable, "-c", code, str(PAYLOAD), str(prompts), str(tmp_path / "out.jsonl")]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    answer, last = out.stdout.splitlines()
    assert '"holds": ["cpu"]' in answer and last == "False 0"
