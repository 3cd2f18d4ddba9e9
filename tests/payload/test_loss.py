"""Decayed CE through the chunked LM head, and the teacher-forced acceptance length."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.loss import dflash_loss, head_cross_entropy, position_weights
from dflash_train.resolve import default_gamma


@pytest.mark.parametrize("block_size,gamma", [(8, 4.0), (10, 5.0), (16, 7.0), (4, 2.0), (22, 9.0)])
def test_default_gamma(block_size, gamma):
    assert default_gamma(block_size) == pytest.approx(gamma)


def test_position_weights_decay_from_one():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert w[14].item() == pytest.approx(math.exp(-14 / 7))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), chunk=st.integers(1, 50), seed=st.integers(0, 1000))
def test_chunked_head_matches_full_logits(rows, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=g, requires_grad=True)
    weight = torch.randn(37, 16, generator=g)
    labels = torch.randint(0, 37, (rows,), generator=g)
    upstream = torch.rand(rows, generator=g)
    ce, pred = head_cross_entropy(hidden, weight, labels, chunk)
    (ce * upstream).sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ weight.T
    ref = F.cross_entropy(logits, labels, reduction="none")
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ce, ref)
    torch.testing.assert_close(grad, hidden.grad)
    assert torch.equal(pred, logits.argmax(-1))


def test_loss_is_weighted_mean_and_acceptance_counts_leading_run():
    # Head = identity over 4 "tokens": hidden one-hot * 10 predicts that token confidently.
    weight = torch.eye(4)
    labels = torch.tensor([[[1, 2, 3], [0, 0, 0]]])  # [N=1, A=2, B-1=3]
    predicted = torch.tensor([[[1, 2, 0], [1, 0, 0]]])  # block 0: 2 right then wrong; block 1: first wrong
    hidden = F.one_hot(predicted, 4).float() * 10
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    out = dflash_loss(hidden, weight, labels, mask, torch.tensor([[True, True]]), gamma=4.0, chunk_rows=2)
    assert out.acceptance_length.item() == pytest.approx(((1 + 2) + (1 + 0)) / 2)
    ce = F.cross_entropy(hidden.view(-1, 4), labels.view(-1), reduction="none").view(1, 2, 3)
    w = position_weights(4, 4.0)
    assert out.loss.item() == pytest.approx(((ce * w).sum() / (2 * w.sum())).item(), rel=1e-6)


def test_invalid_anchors_and_masked_labels_do_not_count():
    weight = torch.eye(4)
    labels = torch.tensor([[[1, 2, 3], [0, 0, 0]]])
    hidden = F.one_hot(labels, 4).float() * 10
    hidden[0, 1] = -hidden[0, 1]  # block 1 all wrong, but invalid
    valid = torch.tensor([[True, False]])
    mask = valid[:, :, None].expand(1, 2, 3)
    out = dflash_loss(hidden, weight, labels, mask, valid, gamma=4.0, chunk_rows=8)
    assert out.acceptance_length.item() == 4.0
    assert out.num_blocks.item() == 1
    only_first = dflash_loss(hidden[:, :1], weight, labels[:, :1], mask[:, :1], valid[:, :1], 4.0, 8)
    assert out.loss.item() == pytest.approx(only_first.loss.item())
