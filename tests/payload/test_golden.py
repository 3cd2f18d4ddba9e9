"""Golden per-step losses of the tiny config: catches accidental changes to the math.

Regenerate (after an intended change, say why in the commit):
    python -m pytest tests/payload/test_golden.py --regen-golden
"""

import json
from pathlib import Path

import pytest

from dflash_train.data import BlockSampler, build_datasets
from dflash_train.replica import build_replica, train_step

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
STEPS = 20


def tiny_losses(plan) -> list[float]:
    """Losses of the first STEPS steps of the default tiny run (seed 0, its 300-step schedule)."""
    cfg = plan.cfg
    train, _ = build_datasets(cfg, cfg.drafter.mask_token_id)
    sampler = BlockSampler(train, cfg.data, cfg.drafter.block_size, cfg.run.seed)
    replica = build_replica(cfg, "cpu", cfg.run.seed, plan.policy)
    return [float(train_step(replica, sampler.batch(step))[0]) for step in range(STEPS)]


def test_tiny_losses_match_golden(tiny_plan, regen_golden):
    losses = tiny_losses(tiny_plan)
    if regen_golden:
        GOLDEN.write_text(
            json.dumps({"steps": STEPS, "config": "tiny preset, seed 0, CPU fp32", "losses": losses}, indent=1) + "\n"
        )
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, rel=1e-5)
    assert losses[-1] < losses[0]  # and it learns
