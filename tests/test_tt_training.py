"""torchtune's training, loss and RLHF names, as a torchtune user calls them: `LinearCrossEntropyLoss` against
`F.cross_entropy` on the full logits (loss and gradients, through `prepare_loss` and a recipe's step), the chunked
losses on `tensor_split` chunks, the seed and dtype helpers, and torchtune's calling forms of `PPOLoss`, `DPOLoss`,
`get_rewards_ppo` and `whiten` against NumPy or a derivation by hand. Fast: tiny shapes, no recipe run."""
import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtune_lit import rlhf, training
from torchtune_lit.models.tiny import tiny_llama
from torchtune_lit.modules.loss import (
    CEWithChunkedOutputLoss,
    ForwardKLLoss,
    ForwardKLWithChunkedOutputLoss,
    LinearCrossEntropyLoss,
)
from torchtune_lit.rlhf.loss import DPOLoss, PPOLoss, RSOLoss

def test_linear_cross_entropy_equals_cross_entropy_on_the_full_logits():
    torch.manual_seed(0)
    head = nn.Module()
    head.output = nn.Linear(16, 300, bias=False)
    hidden = torch.randn(2, 24, 16, requires_grad=True)
    targets = torch.randint(0, 300, (2, 24))
    targets[0, :7] = -100
    reference = F.cross_entropy(head.output(hidden).flatten(0, 1), targets.flatten())
    grads_ref = torch.autograd.grad(reference, [hidden, head.output.weight])
    for chunks, masked in [(8, True), (5, False), (1, True)]:
        loss_fn = LinearCrossEntropyLoss(num_output_chunks=chunks, mask_ignored_tokens=masked)
        loss_fn.set_model_output(head)
        loss = loss_fn(hidden, targets)
        torch.testing.assert_close(loss, reference)
        for got, want in zip(torch.autograd.grad(loss, [hidden, head.output.weight]), grads_ref):
            torch.testing.assert_close(got, want)
    with torch.no_grad():  # no checkpointing without a gradient to take
        torch.testing.assert_close(loss_fn(hidden, targets), reference)


def test_linear_cross_entropy_in_a_recipe_step_matches_plain_cross_entropy():
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = training.shift_labels(tokens)
    results = []
    for loss in (LinearCrossEntropyLoss(num_output_chunks=3), nn.CrossEntropyLoss()):
        torch.manual_seed(0)
        model = tiny_llama(vocab_size=64, num_layers=1, embed_dim=32)
        loss_fn = training.prepare_loss(loss, model)
        summed, count = training.summed_loss(loss_fn, model(tokens), labels)
        summed.backward()
        results.append((summed.detach(), count, [p.grad for p in model.parameters()]))
    (fused, n_fused, g_fused), (plain, n_plain, g_plain) = results
    assert n_fused == n_plain == 2 * 11
    torch.testing.assert_close(fused, plain)
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a, b)


def test_linear_cross_entropy_refuses_logits_and_a_missing_projection():
    model = tiny_llama(vocab_size=64, num_layers=1, embed_dim=32)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (1, 8))
    with pytest.raises(RuntimeError, match="call loss.set_model_output"):
        LinearCrossEntropyLoss()(torch.zeros(1, 8, 32), tokens)
    loss_fn = LinearCrossEntropyLoss()
    loss_fn.set_model_output(model)
    assert model(tokens).shape == (1, 8, 32)
    with pytest.raises(ValueError, match="outputs of width 64, but the output projection takes 32"):
        loss_fn(twin(tokens), tokens)


def test_chunked_losses_take_tensor_split_chunks():
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 41, 30), torch.randn(2, 41, 30)
    labels = torch.randint(0, 30, (2, 41))
    labels[:, :9] = -100
    pieces = logits.tensor_split(8, dim=1)  # 6 + 7 x 5 positions: torch.chunk would make 7
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(CEWithChunkedOutputLoss(8)(pieces, labels), reference)
    torch.testing.assert_close(
        ForwardKLWithChunkedOutputLoss(8)(pieces, teacher.tensor_split(8, dim=1), labels),
        ForwardKLLoss()(logits, teacher, labels),
    )
    with pytest.raises(ValueError, match="got 8 logit chunks but num_output_chunks=4"):
        CEWithChunkedOutputLoss(4)(pieces, labels)


def test_set_seed_returns_the_seed_and_seeds_numpy_and_refuses_out_of_range():
    def draws(seed):
        assert training.set_seed(seed) == seed
        return random.random(), np.random.rand(), torch.rand(1).item()

    assert draws(3) == draws(3) != draws(4)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="Invalid seed value provided"):
            training.set_seed(bad)
    assert 0 <= training.set_seed() < 2**32


def test_dtype_helpers():
    with training.set_default_dtype(torch.bfloat16):
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert training.get_dtype(None) == torch.float32
    assert training.get_dtype(torch.bfloat16) == torch.bfloat16
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Parameter weight has dtype torch.float32"):
        training.validate_expected_param_dtype(layer.named_parameters(), torch.float16)
    training.validate_expected_param_dtype(layer.named_parameters(), torch.float16, ["weight", "bias"])


def test_disable_dropout_and_last_unmasked_position():
    model = nn.Sequential(nn.Dropout(0.1), nn.Linear(3, 3), nn.Dropout(0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training.disable_dropout(model)
    assert len(caught) == 1 and all(m.p == 0 for m in model if isinstance(m, nn.Dropout))
    padding = torch.tensor([[0, 0, 1], [1, 0, 0], [1, 1, 1]]).bool()
    assert training.get_unmasked_sequence_lengths(padding).tolist() == [1, 2, 0]


def test_get_lr_refuses_groups_that_disagree():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.25)
    assert training.get_lr(optimizer) == 0.25
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5})
    with pytest.raises(RuntimeError, match="not one"):
        training.get_lr(optimizer)


def test_whiten_and_masked_var_against_numpy():
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64) * 3 + 2
    mask = torch.rand(6, 5) > 0.3
    kept = x[mask].numpy()
    mean, var = kept.mean(), kept.var(ddof=1)
    torch.testing.assert_close(
        rlhf.masked_var(x - rlhf.masked_mean(x, mask), mask), torch.tensor(var, dtype=x.dtype)
    )
    centred = (x.numpy() - mean) / np.sqrt(var + 1e-8)
    torch.testing.assert_close(rlhf.whiten(x, mask, shift_mean=False), torch.from_numpy(centred))
    torch.testing.assert_close(rlhf.whiten(x, mask), torch.from_numpy(centred + mean))


def test_torchtune_forms_of_ppo_pieces_agree_with_ours():
    torch.manual_seed(0)
    logps, old, ref = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    advantages, returns = torch.randn(3, 4), torch.randn(3, 4)
    values, old_values = torch.randn(3, 4), torch.randn(3, 4)
    full = torch.ones(3, 4, dtype=torch.bool)
    ours, stats = PPOLoss()(logps, old, advantages, values, old_values, returns, full)
    loss, policy_loss, value_loss, ratio, _ = PPOLoss()(old, logps, advantages, old_values, values, returns)
    torch.testing.assert_close(loss, ours)
    torch.testing.assert_close(policy_loss, stats["policy_loss"])
    torch.testing.assert_close(ratio, (logps - old).exp().mean())
    scores = torch.tensor([1.0, -1.0, 0.5])
    rewards, kl = rlhf.get_rewards_ppo(scores, logps, ref, full, 0.2)
    tt_rewards, tt_kl, kl_rewards = rlhf.get_rewards_ppo(scores, logps, ref, 0.2)
    torch.testing.assert_close(tt_rewards, rewards)
    torch.testing.assert_close(kl_rewards, -0.2 * tt_kl)
    _, returns_ours = rlhf.estimate_advantages(values, rewards, 0.9, 0.95, full)
    _, returns_all = rlhf.estimate_advantages(values, rewards, 0.9, 0.95)
    torch.testing.assert_close(returns_all, returns_ours)


def test_dpo_and_rso_take_chosen_rejected_outputs():
    empty = torch.zeros(0)
    policy = rlhf.ChosenRejectedOutputs(torch.tensor([-1.0]), torch.tensor([-3.0]), empty, empty)
    reference = rlhf.ChosenRejectedOutputs(torch.tensor([-2.0]), torch.tensor([-2.0]), empty, empty)
    # margin h = 2: DPO -log sigmoid(0.2) = log(1 + e^-0.2); RSO max(0, 1 - 0.1 * 2)
    torch.testing.assert_close(DPOLoss(beta=0.1)(policy, reference)[0], torch.tensor([0.598139]))
    torch.testing.assert_close(RSOLoss(gamma=0.1)(policy, reference)[0], torch.tensor([0.8]))
    with pytest.raises(TypeError, match="two ChosenRejectedOutputs"):
        DPOLoss()(torch.tensor([-1.0]), torch.tensor([-3.0]))


def test_truncate_at_first_stop_token():
    mask, sequences = rlhf.truncate_sequence_at_first_stop_token(
        torch.tensor([[4, 9, 4, 4], [9, 1, 2, 3], [1, 2, 3, 4]]), torch.tensor([9]), fill_value=-1
    )
    assert sequences.tolist() == [[4, 9, -1, -1], [9, -1, -1, -1], [1, 2, 3, 4]]
    assert mask.sum(1).tolist() == [2, 3, 0]


def test_distillation_refuses_the_fused_loss_in_one_line():
    "KD needs the student's logits; LinearCrossEntropyLoss would make it return hidden states."
    from torchtune_lit.models.tiny import tiny_llama
    from torchtune_lit.modules.loss import (
        ForwardKLWithChunkedOutputLoss,
        LinearCrossEntropyLoss,
    )
    from torchtune_lit.training.distillation import build_losses

    with pytest.raises(ValueError, match="kd_loss needs its logits"):
        build_losses(LinearCrossEntropyLoss(), ForwardKLWithChunkedOutputLoss(), tiny_llama(), tiny_llama())
