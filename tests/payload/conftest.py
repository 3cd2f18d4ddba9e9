"""Payload tests: put remote_payload/ on sys.path (it runs with cwd=remote_payload/ in containers)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_payload"))

import torch  # noqa: E402

from dflash_train.config import load_config  # noqa: E402
from dflash_train.train import resolve_config  # noqa: E402

# Tiny ops gain nothing from intra-op threads, and OpenMP spin-waits on a busy 2-core runner
# make 2 threads an order of magnitude slower than 1.
torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg(tmp_path):
    """The resolved tiny config, writing into a temporary output dir."""
    return resolve_config(load_config(overrides=[f"run.output_dir={tmp_path / 'run'}"]))
