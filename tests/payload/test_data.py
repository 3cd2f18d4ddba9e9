"""Anchor sampling, deterministic batches, JSONL rows."""

import json

import pytest
import torch

from dflash_train.config import DataConfig
from dflash_train.data import BlockSampler, load_jsonl, sample_anchors, seeded_generator


def test_anchors_have_loss_mask_and_room_for_a_block():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:40] = True
    for seed in range(20):
        anchors, valid = sample_anchors(mask, 6, 8, seeded_generator(seed))
        assert valid.all()
        assert (anchors >= 10).all() and (anchors + 8 <= 40).all()
        assert anchors.unique().numel() == 6 and torch.equal(anchors, anchors.sort().values)


def test_short_sequences_pad_with_invalid_anchors():
    mask = torch.ones(10, dtype=torch.bool)
    anchors, valid = sample_anchors(mask, 5, 8, seeded_generator(0))  # positions 0..2 fit a block
    assert valid.tolist() == [True, True, True, False, False]
    assert anchors[:3].tolist() == [0, 1, 2]


def _seqs(n, length=32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 100, (length,), generator=g), torch.ones(length, dtype=torch.bool))
            for _ in range(n)]


def test_batches_are_a_pure_function_of_step():
    cfg = DataConfig(max_length=32, anchors_per_seq=4, batch_size=4)
    a = BlockSampler(_seqs(12), cfg, block_size=4, seed=3)
    b = BlockSampler(_seqs(12), cfg, block_size=4, seed=3)
    assert a.steps_per_epoch == 3
    for step in (5, 0, 4):
        x, y = a.batch(step), b.batch(step)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.anchors, y.anchors)
    # A new epoch reshuffles and resamples anchors.
    assert not torch.equal(a.batch(0).anchors, a.batch(3).anchors)


def test_jsonl_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n\n"
                    + json.dumps({"input_ids": [1, 2]}) + "\n")
    seqs = load_jsonl(path)
    assert [s[0].tolist() for s in seqs] == [[5, 6, 7], [1, 2]]
    assert [s[1].tolist() for s in seqs] == [[False, True, True], [True, True]]
    path.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [1]}) + "\n")
    with pytest.raises(ValueError, match="differ in length"):
        load_jsonl(path)


def test_chat_rows_without_transformers_say_so(tmp_path):
    try:
        import transformers  # noqa: F401
        pytest.skip("transformers is installed")
    except ImportError:
        pass
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="transformers"):
        load_jsonl(path, tokenizer_path=str(tmp_path))
