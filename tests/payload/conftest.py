"""Payload tests: put remote_payload/ on sys.path (it runs with cwd=remote_payload/ in containers)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote_payload"))

import torch  # noqa: E402

from dflash_train.config import load_config  # noqa: E402
from dflash_train.plan import resolve_run  # noqa: E402

# Tiny ops gain nothing from intra-op threads, and OpenMP spin-waits on a busy 2-core runner
# make 2 threads an order of magnitude slower than 1.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden",
        action="store_true",
        default=False,
        help="rewrite tests/payload/golden/*.json from this run (after an intended change to the math)",
    )


@pytest.fixture
def regen_golden(request) -> bool:
    """True when pytest ran with --regen-golden."""
    return bool(request.config.getoption("--regen-golden", default=False))  # absent unless this conftest loaded first


@pytest.fixture
def tiny_plan(tmp_path):
    """The tiny run's plan on this CPU, writing into a temporary output dir."""
    return resolve_run(load_config(overrides=[f"run.output_dir={tmp_path / 'run'}"]), cuda_count=0)


@pytest.fixture
def tiny_cfg(tiny_plan):
    """The resolved tiny config (the plan's)."""
    return tiny_plan.cfg
