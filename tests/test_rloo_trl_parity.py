"""RLOO against TRL's own `RLOOTrainer` (trl 1.16, a dev dependency). TRL computes the KL-penalised rewards and the
leave-one-out advantages inside `_generate_and_score_completions` and the loss in `_compute_loss`; both run unchanged
here on a minimal stand-in for the trainer (settings from a real `RLOOConfig`, "generated" answers of our mask's
lengths, our per-token log-probabilities for the policy and the reference, our reward matrix). Our
`kl_penalized_rewards` + `leave_one_out_advantages` equal TRL's advantages, and `RLOOLoss` its loss and gradient with
respect to the per-token log-probabilities, within 1e-6, as in the RLOO chapter (nbs/65b_rloo.ipynb)."""
import collections
import types

import pytest
import torch

from torchtune_lit.rlhf import RLOOLoss, kl_penalized_rewards, leave_one_out_advantages

TRL_MISSING = "trl is not importable (a dev dependency: pip install trl==1.16.0)"

SETTINGS = {  # name: (group size, TRL's RLOOConfig settings)
    "default": (4, dict()),
    "no_kl": (4, dict(beta=0.0)),
    "strong_kl": (4, dict(beta=0.3)),
    "pairs": (2, dict()),
    "groups_of_8": (8, dict()),
    "normalized": (4, dict(normalize_advantages=True)),
    "weighted": (4, dict(reward_weights=[1.0, 0.2])),
    "clipped_rewards": (4, dict(reward_clip_range=(-0.5, 1.5))),
}


@pytest.fixture(scope="module")
def trl():
    "TRL's RLOOConfig and RLOOTrainer (imported once: the import takes seconds)."
    try:
        from trl import RLOOConfig
        from trl.trainer.rloo_trainer import RLOOTrainer
    except ImportError as error:
        pytest.skip(f"{TRL_MISSING}: {error}")
    return RLOOConfig, RLOOTrainer


def stand_in(args, logps_of, rewards_per_func, mask):
    "What RLOOTrainer's two methods read, as its __init__ sets it; `logps_of(model)` answers for policy / reference."
    n = len(mask)
    answers = [[5] * int(k) for k in mask.sum(dim=1)]
    logs = {k: collections.deque() for k in ("prompt", "completion", "advantages")}
    logs["rewards"], logs["extra"] = collections.defaultdict(list), collections.defaultdict(list)
    weights = torch.tensor(args.reward_weights) if args.reward_weights else torch.ones(rewards_per_func.shape[1])
    return types.SimpleNamespace(
        args=args, model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        ref_model="reference" if args.beta else None, beta=args.beta, num_generations=args.num_generations,
        normalize_advantages=args.normalize_advantages, reward_clip_range=args.reward_clip_range,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        mask_truncated_completions=False, pad_to_multiple_of=None, aux_loss_enabled=False,
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), process_index=0,
                                          reduce=lambda x, reduction: x, gather=lambda x: x),
        _generate=lambda prompts: ([[1, 2]] * n, answers, ["answer"] * n),
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (logps_of(model), torch.zeros(mask.shape), None),
        _calculate_rewards=lambda *a: rewards_per_func, reward_weights=weights,
        reward_func_names=[f"reward_{i}" for i in range(rewards_per_func.shape[1])],
        _metrics={"train": collections.defaultdict(list)}, _logs=logs,
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
    )


def config(trl, group_size, **settings):
    return trl[0](output_dir="unused", use_cpu=True, bf16=False, report_to=[], activation_checkpointing=False,
                  num_generations=group_size, per_device_train_batch_size=group_size, **settings)


def random_batch(seed: int, group_size: int, groups: int = 3, length: int = 7):
    "Sampling-policy and reference log-probs, answers of 1..length tokens, two reward columns."
    generator = torch.Generator().manual_seed(seed)
    n = group_size * groups
    old = -torch.rand(n, length, generator=generator) * 3
    ref = old + 0.2 * torch.randn(n, length, generator=generator)
    lengths = torch.randint(1, length + 1, (n, 1), generator=generator)
    lengths[0] = length  # the padded width is the longest answer's
    rewards = torch.randint(0, 3, (n, 2), generator=generator).float() / 2  # 0, 0.5 or 1
    return old, ref, torch.arange(length)[None, :] < lengths, rewards


def trl_advantages(trl, args, old, ref, mask, rewards):
    trainer = stand_in(args, lambda m: ref if m == "reference" else old, rewards, mask)
    return trl[1]._generate_and_score_completions(trainer, [{"prompt": "p"}] * len(mask))


def our_advantages(args, old, ref, mask, rewards):
    "TRL's order: weighted sum, clip, KL penalty from the sampling policy, leave-one-out, normalisation."
    weights = torch.tensor(args.reward_weights) if args.reward_weights else torch.ones(rewards.shape[1])
    total = (rewards * weights).sum(dim=1)
    if args.reward_clip_range:
        total = total.clamp(*args.reward_clip_range)
    penalised = kl_penalized_rewards(total, old, ref, mask, args.beta)
    return leave_one_out_advantages(penalised, args.num_generations, normalize=args.normalize_advantages)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_advantages_equal_trl(trl, name):
    group_size, settings = SETTINGS[name]
    args = config(trl, group_size, **settings)
    old, ref, mask, rewards = random_batch(seed=len(name), group_size=group_size)
    theirs = trl_advantages(trl, args, old, ref, mask, rewards)
    assert theirs["completion_mask"].bool().equal(mask)
    torch.testing.assert_close(our_advantages(args, old, ref, mask, rewards), theirs["advantages"], atol=1e-6, rtol=0)


def test_the_settings_differ(trl):
    "The parity above is not vacuous: on the same tensors, the settings give different advantages."
    old, ref, mask, rewards = random_batch(seed=0, group_size=4)
    values = {name: tuple(our_advantages(config(trl, 4, **s), old, ref, mask, rewards).round(decimals=5).tolist())
              for name, (size, s) in SETTINGS.items() if size == 4}
    assert len(set(values.values())) == len(values), values


@pytest.mark.parametrize("moved, settings", [
    (0.0, dict()),                         # on-policy: ratio 1, REINFORCE
    (0.3, dict()),                         # off-policy: some answers clipped
    (0.3, dict(epsilon=0.1, epsilon_high=0.4)),   # asymmetric clip
    (0.05, dict(epsilon=0.2)),
])
def test_loss_and_gradient_equal_trl(trl, moved, settings):
    args = config(trl, 4, **settings)
    old, ref, mask, rewards = random_batch(seed=7, group_size=4)
    inputs = trl_advantages(trl, args, old, ref, mask, rewards)
    policy = old + moved * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    our_logps, trl_logps = policy.clone().requires_grad_(), policy.clone().requires_grad_()
    trainer = stand_in(args, lambda m: trl_logps, rewards, mask)
    theirs = trl[1]._compute_loss(trainer, None, inputs)
    losses, stats = RLOOLoss(args.epsilon, args.epsilon_high)(our_logps, old, inputs["advantages"], mask)
    (theirs + losses.mean()).backward()
    torch.testing.assert_close(losses.mean(), theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_logps.grad, trl_logps.grad, atol=1e-6, rtol=0)
    clipped = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    assert abs(stats["clipfrac"].mean().item() - clipped) < 1e-6
    if moved == 0.0:
        assert stats["ratio"].eq(1).all() and clipped == 0
    if moved == 0.3:
        assert clipped > 0  # the clip is exercised


@pytest.mark.parametrize("call, words", [
    (lambda: leave_one_out_advantages(torch.zeros(6), 4), ["6 rewards", "groups of 4"]),
    (lambda: RLOOLoss(epsilon=-0.1), ["epsilon", ">= 0"]),
])
def test_bad_inputs_are_refused(call, words):
    with pytest.raises(ValueError) as error:
        call()
    assert all(w in str(error.value) for w in words), str(error.value)
