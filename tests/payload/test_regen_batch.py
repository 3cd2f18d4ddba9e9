"""The builtin regen engine's default batch (regen_batch.auto_batch): the rule on the shapes and
memories users have, and its weight count against the parameters of the model it sizes for."""

from __future__ import annotations

from dataclasses import replace

import torch

from dflash_train.config import load_config
from dflash_train.regen_batch import (
    MAX_AUTO_BATCH,
    MAX_AUTO_BATCH_TRANSFORMERS,
    auto_batch,
    cache_bytes_per_position,
    weight_bytes,
)
from dflash_train.target import Qwen3Target

GIB = 1 << 30


def qwen3_8b():
    """The qwen3-8b preset's target shape."""
    return load_config(preset="qwen3-8b").target


def test_weight_count_is_the_models_parameter_count():
    t = qwen3_8b()
    with torch.device("meta"):
        model = Qwen3Target(t, t.num_layers)
    params = {id(p): p.numel() for p in model.parameters()}  # a tied head counted once
    counted = weight_bytes(t, 2) // 2
    assert abs(counted - sum(params.values())) / sum(params.values()) < 1e-3  # norms are not counted


def test_an_h200_gets_the_largest_batch_smaller_gpus_a_batch_that_fits():
    t = qwen3_8b()
    assert auto_batch(t, "bf16", 512, 141 * GIB)[0] == MAX_AUTO_BATCH == 256
    assert auto_batch(t, "bf16", 512, 80 * GIB)[0] == 128
    assert auto_batch(t, "bf16", 512, 48 * GIB)[0] == 64
    small, why = auto_batch(t, "bf16", 512, 24 * GIB)
    assert 1 <= small < 32  # the old fixed default (32) does not fit beside 16 GB of weights
    room = 0.85 * 24 * GIB - weight_bytes(t, 2) - 3 * GIB
    assert small * 2048 * cache_bytes_per_position(t, 2) <= room < 2 * small * 2048 * cache_bytes_per_position(t, 2)
    assert "24.0 GiB" in why and "--batch-size" in why


def test_a_transformers_target_keeps_the_smaller_cap_its_whole_batch_prefill_needs():
    t = replace(qwen3_8b(), backend="transformers")
    batch, why = auto_batch(t, "bf16", 512, 141 * GIB)
    assert batch == MAX_AUTO_BATCH_TRANSFORMERS == 128 and "at most 128" in why


def test_longer_generations_take_smaller_batches_and_cpu_keeps_its_default():
    t = qwen3_8b()
    batches = [auto_batch(t, "bf16", new, 48 * GIB)[0] for new in (512, 4096, 16384)]
    assert batches == sorted(batches, reverse=True) and batches[0] > batches[-1]
    assert auto_batch(t, "bf16", 512, None) == (32, "auto: 32 on CPU")


def test_a_target_that_leaves_no_room_gets_batch_1():
    assert auto_batch(qwen3_8b(), "bf16", 512, 16 * GIB)[0] == 1
