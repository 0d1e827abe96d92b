"""LayerSkip's early-exit loss (nbs/17f_early_exit_loss.ipynb): the loss scales against the values derived by hand
in the chapter, the loss against the per-layer cross-entropy sum written out from its formula on a tiny decoder,
and the curricula against their step-by-step schedules worked out by hand."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtune_lit.models.llama3_2 import llama3_2
from torchtune_lit.modules.early_exit_loss import (
    EarlyExitCurriculum,
    GradualEarlyExitCurriculum,
    RotationalEarlyExitCurriculum,
    early_exit_loss,
    inv_l_loss_scale,
    inv_sqrt_l_loss_scale,
    linear_l_loss_scale,
    sqrt_l_loss_scale,
    sum_l_loss_scale,
    uniform_loss_scale,
)

VOCAB = 48


@pytest.fixture(scope="module")
def tiny():
    "A 3-layer decoder, a batch with some ignored labels, and each layer's output."
    torch.manual_seed(1)
    model = llama3_2(
        vocab_size=VOCAB,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        max_seq_len=16,
    )
    tokens = torch.randint(0, VOCAB, (3, 6))
    labels = torch.randint(0, VOCAB, (3, 6))
    labels[1, :4] = -100
    h, hidden = model.tok_embeddings(tokens), {}
    for i, layer in enumerate(model.layers):
        h = layer(h)
        hidden[i] = h
    return model, tokens, labels, hidden


def test_scales_by_hand():
    ids = torch.arange(4)
    # l + 1 = 1, 2, 3, 4; running sums 1, 3, 6, 10; inverses sum to 25/12
    torch.testing.assert_close(
        linear_l_loss_scale(ids, 4), torch.tensor([1, 2, 3, 4]) / 10
    )
    torch.testing.assert_close(
        sum_l_loss_scale(ids, 4), torch.tensor([1, 3, 6, 10]) / 20
    )
    torch.testing.assert_close(
        inv_l_loss_scale(ids, 4), torch.tensor([12, 6, 4, 3]) / 25
    )
    torch.testing.assert_close(uniform_loss_scale(ids, 4), torch.full((4,), 0.25))
    roots = torch.tensor([1.0, 2**0.5, 3**0.5, 2.0])
    torch.testing.assert_close(sqrt_l_loss_scale(ids, 4), roots / roots.sum())
    torch.testing.assert_close(
        inv_sqrt_l_loss_scale(ids, 4), (1 / roots) / (1 / roots).sum()
    )
    # e_scale multiplies the early layers only: 0.5, 1, 1.5, 4 over 7
    torch.testing.assert_close(
        linear_l_loss_scale(ids, 4, 0.5), torch.tensor([1, 2, 3, 8]) / 14
    )
    # a subset: layers 1 and 3 of 4, running sums 2 and 6
    torch.testing.assert_close(
        sum_l_loss_scale(torch.tensor([1, 3]), 4), torch.tensor([0.25, 0.75])
    )


def test_loss_equals_written_out_sum(tiny):
    model, tokens, labels, hidden = tiny
    loss = early_exit_loss(
        model,
        hidden,
        labels,
        nn.CrossEntropyLoss(),
        e_scale=2.0,
        loss_scale_fn=inv_l_loss_scale,
    )
    # inverse weights 1, 1/2, 1/3; the early two doubled: 2, 1, 1/3 over 10/3
    weights = torch.tensor([2.0, 1.0, 1 / 3]) * 3 / 10
    reference = sum(
        w
        * F.cross_entropy(
            model.output(model.norm(hidden[i])).reshape(-1, VOCAB), labels.reshape(-1)
        )
        for i, w in enumerate(weights)
    )
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


def test_last_layer_alone_is_the_ordinary_loss(tiny):
    model, tokens, labels, hidden = tiny
    ordinary = F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1))
    last = early_exit_loss(model, {2: hidden[2]}, labels, nn.CrossEntropyLoss())
    torch.testing.assert_close(last, ordinary, rtol=1e-6, atol=1e-6)
    # a loss built with reduction="sum" still gives the per-token mean
    summed = early_exit_loss(
        model, {2: hidden[2]}, labels.reshape(-1), nn.CrossEntropyLoss(reduction="sum")
    )
    torch.testing.assert_close(summed, ordinary, rtol=1e-6, atol=1e-6)


def test_rotational_schedule():
    curriculum = RotationalEarlyExitCurriculum(
        [True, False, False, False, True, False], max_steps=10
    )
    seen = []
    for _ in range(3):
        seen.append(np.flatnonzero(curriculum.get()).tolist())
        curriculum.step()
    # layer 4 moves to 5 (always on: the last layer) and wraps to 0
    assert seen == [[0, 4, 5], [1, 5], [0, 2, 5]]
    resumed = RotationalEarlyExitCurriculum(
        [True, False, False, False, True, False], 10, False, last_step=4
    )
    assert np.flatnonzero(resumed.get()).tolist() == [2, 4]  # 4 + 4 wraps to 2


def test_gradual_schedule():
    # n = 5, max_steps = 20, fraction 0.5: on call k, layer i when k - 1 >= 2 * (5 - i)
    curriculum = GradualEarlyExitCurriculum(
        [True] * 5, max_steps=20, train_last_layer=False
    )
    joined = {}
    for k in range(1, 13):
        curriculum.step()
        for i in np.flatnonzero(curriculum.get()):
            joined.setdefault(int(i), k)
    assert joined == {4: 3, 3: 5, 2: 7, 1: 9, 0: 11}
    resumed = GradualEarlyExitCurriculum([True] * 5, 20, False, last_step=7)
    assert np.flatnonzero(resumed.get()).tolist() == [2, 3, 4]
    assert EarlyExitCurriculum([False, True, False], 5).get().tolist() == [
        False,
        True,
        True,
    ]


def test_empty_hidden_states_is_one_clear_line(tiny):
    model, _, labels, _ = tiny
    with pytest.raises(ValueError, match="hidden_states_dict is empty") as error:
        early_exit_loss(model, {}, labels, nn.CrossEntropyLoss())
    assert "\n" not in str(error.value)
