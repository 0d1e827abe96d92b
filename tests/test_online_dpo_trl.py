"""Online DPO against TRL's own `OnlineDPOTrainer` (trl 1.16, `trl.experimental.online_dpo`, a dev dependency).
TRL judges, pairs and scores in `training_step`; it runs unchanged here on a minimal stand-in for the trainer
(settings from a real `OnlineDPOConfig`; "generated" answers of our mask's lengths; our per-token log-probabilities
for the policy and the reference; our rewards). Our pairing (`reward_pairs`) + summed log-probabilities + `DPOLoss`
(TRL's `loss_type="sigmoid"`) or `IPOLoss` (`"ipo"`) equal TRL's loss, its gradient with respect to the policy's
per-token log-probabilities, and its logged rewards/margins, within 1e-6. TRL keeps a tie (the first answer is
"chosen"); the recipe skips it, so with ties ours equals TRL run on the untied prompts."""
import collections
import os
import types

import pytest
import torch

from torchtune_lit.recipes.online_dpo_single_device import (
    reward_pairs,
    summed_log_probs,
)
from torchtune_lit.rlhf.loss import DPOLoss, IPOLoss

TRL_MISSING = "trl is not importable (a dev dependency: pip install trl==1.16.0)"
EOS = 2


@pytest.fixture(scope="module")
def trl():
    "TRL's OnlineDPOConfig and OnlineDPOTrainer (imported once: the import takes seconds)."
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # it is experimental in trl 1.16
    try:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    except ImportError as error:
        pytest.skip(f"{TRL_MISSING}: {error}")
    return OnlineDPOConfig, OnlineDPOTrainer


def stand_in(args, policy, reference, rewards, mask):
    "What `training_step` reads, as `__init__` sets it: TRL's rows are [first answers; second answers]."
    n, length = mask.shape
    completion_ids = torch.where(mask, 5, 0)
    completion_ids[torch.arange(n), mask.sum(dim=1) - 1] = EOS  # every answer ends
    captured = {}
    trainer = types.SimpleNamespace(
        args=args, beta=args.beta[0] if isinstance(args.beta, list) else args.beta, ref_model="reference", reward_funcs=["judge"], eos_token_ids=[EOS],
        stats=collections.defaultdict(list), state=types.SimpleNamespace(global_step=0),
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x,
                                          backward=lambda loss, **kw: captured.setdefault("loss", loss)),
        _generate=lambda model, prompts, images: (torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3),
                                                  completion_ids, mask.long(), None),
        _forward=lambda model, *a: reference if model == "reference" else policy,
        processing_class=types.SimpleNamespace(batch_decode=lambda ids, **kw: ["answer"] * len(ids)),
        _calculate_rewards_from_functions=lambda **kw: rewards,
    )
    return trainer, captured


def config(trl, loss_type: str, beta: float):
    return trl[0](output_dir="unused", use_cpu=True, bf16=False, report_to=[], loss_type=loss_type, beta=beta)


def random_batch(seed: int, prompts: int = 5, length: int = 6):
    "Policy and reference per-token log-probs, answers of 1..length tokens, rewards 0 / 0.2 / 1 / 1.2 (TRL's order)."
    generator = torch.Generator().manual_seed(seed)
    ref = -torch.rand(2 * prompts, length, generator=generator) * 3
    policy = ref + 0.3 * torch.randn(2 * prompts, length, generator=generator)
    lengths = torch.randint(1, length + 1, (2 * prompts, 1), generator=generator)
    lengths[0] = length
    rewards = torch.tensor([0.0, 0.2, 1.0, 1.2])[torch.randint(0, 4, (2 * prompts,), generator=generator)]
    return policy, ref, torch.arange(length)[None, :] < lengths, rewards


def interleave(x: torch.Tensor) -> torch.Tensor:
    "TRL's [first answers; second answers] -> the recipe's rollout order (prompt i: rows 2i, 2i + 1)."
    first, second = x.chunk(2)
    return torch.stack([first, second], dim=1).flatten(0, 1)


def ours(loss_fn, policy, ref, mask, rewards):
    "The recipe's step on TRL's tensors: pair by reward, sum each answer's log-probs, the pair loss."
    policy, ref, mask, rewards = map(interleave, (policy, ref, mask, rewards))
    chosen, rejected, ties = reward_pairs(rewards)
    pol, ref = summed_log_probs(policy, mask), summed_log_probs(ref, mask)
    losses, chosen_r, rejected_r = loss_fn(pol[chosen], pol[rejected], ref[chosen], ref[rejected])
    return losses.mean(), chosen_r, rejected_r, ties


LOSSES = {"sigmoid": lambda beta: DPOLoss(beta=beta), "ipo": lambda beta: IPOLoss(tau=beta)}


def untied(seed: int):
    "A batch without ties, so TRL's pairs and ours are the same."
    policy, ref, mask, rewards = random_batch(seed)
    first, second = rewards.chunk(2)
    second = torch.where(first == second, first + 1.0, second)
    return policy, ref, mask, torch.cat([first, second])


@pytest.mark.parametrize("loss_type", list(LOSSES))
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_gradient_and_rewards_equal_trl(trl, loss_type, beta):
    policy, ref, mask, rewards = untied(seed=int(beta * 10) + len(loss_type))
    args = config(trl, loss_type, beta)
    trl_logps, our_logps = policy.clone().requires_grad_(), policy.clone().requires_grad_()
    trainer, captured = stand_in(args, trl_logps, ref, rewards, mask)
    returned = trl[1].training_step(trainer, types.SimpleNamespace(train=lambda: None), {"prompt": ["p"] * 5})
    loss, chosen_r, rejected_r, ties = ours(LOSSES[loss_type](beta), our_logps, ref, mask, rewards)
    assert ties == 0
    (captured["loss"] + loss).backward()
    torch.testing.assert_close(loss.detach(), returned, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_logps.grad, trl_logps.grad, atol=1e-6, rtol=0)
    assert trl_logps.grad.abs().sum() > 0 and trl_logps.grad[~mask].eq(0).all()  # padding gets none
    stats = trainer.stats
    assert abs(chosen_r.mean().item() - stats["rewards/chosen"][-1]) < 1e-6
    assert abs((chosen_r - rejected_r).mean().item() - stats["rewards/margins"][-1]) < 1e-6


def test_the_loss_types_differ(trl):
    "The parity above is not vacuous: sigmoid and ipo (and two betas) give different losses on the same tensors."
    policy, ref, mask, rewards = untied(seed=3)
    values = {(t, b): round(ours(LOSSES[t](b), policy, ref, mask, rewards)[0].item(), 5)
              for t in LOSSES for b in (0.1, 0.5)}
    assert len(set(values.values())) == 4, values


def test_ties_are_skipped_where_trl_keeps_them(trl):
    "With ties: TRL pairs every prompt; ours equals TRL on the untied prompts only, and counts the ties."
    policy, ref, mask, rewards = random_batch(seed=11, prompts=6)
    first, second = rewards.chunk(2)
    second[:2] = first[:2]  # prompts 0 and 1 tie
    second[2:] = torch.where(first[2:] == second[2:], first[2:] + 1.0, second[2:])
    rewards = torch.cat([first, second])
    loss, _, _, ties = ours(DPOLoss(beta=0.1), policy, ref, mask, rewards)
    assert ties == 2
    keep = torch.tensor([i for i in range(12) if i % 6 >= 2])  # both halves of prompts 2..5
    args = config(trl, "sigmoid", 0.1)
    trainer, _ = stand_in(args, policy[keep], ref[keep], rewards[keep], mask[keep])
    on_untied = trl[1].training_step(trainer, types.SimpleNamespace(train=lambda: None), {"prompt": ["p"] * 4})
    torch.testing.assert_close(loss, on_untied, atol=1e-6, rtol=0)
    trainer, _ = stand_in(args, policy, ref, rewards, mask)
    with_ties = trl[1].training_step(trainer, types.SimpleNamespace(train=lambda: None), {"prompt": ["p"] * 6})
    assert abs(with_ties.item() - loss.item()) > 1e-4  # TRL trains on the ties too


def test_reward_pairs_by_hand():
    "Rows 2i, 2i+1 are prompt i's answers; the higher reward is chosen; a tie is skipped and counted."
    chosen, rejected, ties = reward_pairs(torch.tensor([1.0, 0.2, 0.0, 1.2, 0.5, 0.5]))
    assert chosen.tolist() == [0, 3] and rejected.tolist() == [1, 2] and ties == 1
    with pytest.raises(ValueError, match="two answers per prompt"):
        reward_pairs(torch.tensor([1.0, 0.2, 0.0]))
