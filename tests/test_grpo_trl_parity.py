"""`GRPOLoss` against TRL's own GRPO loss (trl 1.16, a dev dependency): for every `loss_type`, clip-higher, GSPO's
sequence-level ratio and TRL's reweighted KL term, the batch loss and its gradient with respect to the per-token
log-probabilities equal what `GRPOTrainer._compute_loss` computes on the same random tensors, within 1e-6. TRL's
method runs unchanged on a minimal stand-in for the trainer (settings from a real `GRPOConfig`, a "model" that
returns our log-probabilities), as in the GRPO chapter (nbs/65_grpo.ipynb)."""
import collections
import types

import pytest
import torch

from torchtune_lit.rlhf.loss import GRPOLoss

TRL_MISSING = "trl is not importable (a dev dependency: pip install trl==1.16.0)"

VARIANTS = {  # name: TRL's GRPOConfig settings besides beta=0.04
    "grpo": dict(loss_type="grpo", use_bias_correction_kl=False),
    "grpo_kl_reweighted": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo", use_bias_correction_kl=False),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=8),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "vespo_shapes": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=1.0),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "gspo_dapo": dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_high=0.28),
    "grpo_no_kl": dict(loss_type="grpo", beta=0.0),
}


@pytest.fixture(scope="module")
def trl():
    "TRL's GRPOConfig and GRPOTrainer (imported once: the import takes seconds)."
    try:
        from trl import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer
    except ImportError as error:
        pytest.skip(f"{TRL_MISSING}: {error}")
    return GRPOConfig, GRPOTrainer


def trl_loss(trl, settings, logps, old_logps, ref_logps, advantages, mask, num_items=None):
    "TRL's loss for one micro-batch; `num_items`: answer tokens of the whole step (dapo, cispo, vespo)."
    config_class, trainer_class = trl
    args = config_class(output_dir="unused", use_cpu=True, bf16=False, activation_checkpointing=False,
                        report_to=[], **settings)
    n, length = logps.shape

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logps, torch.zeros(n, length), None  # log-probs, entropies, aux loss

    trainer = types.SimpleNamespace(
        args=args, model=types.SimpleNamespace(training=True),
        _get_per_token_logps_and_entropies=per_token_logps, get_gamma_weights=trainer_class.get_gamma_weights,
        loss_type=args.loss_type, beta=args.beta, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        max_completion_length=args.max_completion_length, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": collections.defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, length, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": advantages, "old_per_token_logps": old_logps, "ref_per_token_logps": ref_logps,
        "num_items_in_batch": mask.sum() if num_items is None else torch.tensor(num_items),
    }
    return trainer_class._compute_loss(trainer, None, inputs)


def ours(settings: dict) -> GRPOLoss:
    "Our GRPOLoss for TRL's settings: `beta` is `kl_coeff`; TRL's defaults for the rest named explicitly."
    kwargs = {"loss_type": "dapo", "use_bias_correction_kl": True, **settings}
    kwargs.pop("gradient_accumulation_steps", None)
    return GRPOLoss(kwargs.pop("epsilon", 0.2), kwargs.pop("beta"), **kwargs)


def random_batch(seed: int, n: int = 8, length: int = 8):
    "Per-token log-probs of answers of 1..length tokens; old policy and reference 0.2 nats away per token."
    generator = torch.Generator().manual_seed(seed)
    base = -torch.rand(n, length, generator=generator) * 3
    old = base + 0.2 * torch.randn(n, length, generator=generator)
    ref = base + 0.2 * torch.randn(n, length, generator=generator)
    advantages = torch.randn(n, generator=generator)
    lengths = torch.randint(1, length + 1, (n, 1), generator=generator)
    return base, old, ref, advantages, torch.arange(length)[None, :] < lengths


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_and_gradient_equal_trl(trl, name):
    settings = {"beta": 0.04, **VARIANTS[name]}
    base, old, ref, advantages, mask = random_batch(seed=len(name))
    theirs_logps, our_logps = base.clone().requires_grad_(), base.clone().requires_grad_()
    theirs = trl_loss(trl, settings, theirs_logps, old, ref, advantages, mask)
    losses, _ = ours(settings)(our_logps, old, ref, advantages, mask)
    (theirs + losses.mean()).backward()
    torch.testing.assert_close(losses.mean(), theirs.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(our_logps.grad, theirs_logps.grad, atol=1e-6, rtol=0)


def test_the_variants_differ():
    "The parity above is not vacuous: on the same tensors, the variants give different losses."
    base, old, ref, advantages, mask = random_batch(seed=0)
    values = {name: ours({"beta": 0.04, **settings})(base, old, ref, advantages, mask)[0].mean().item()
              for name, settings in VARIANTS.items()}
    assert len({round(v, 6) for v in values.values()}) == len(values), values


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_token_mean_over_micro_batches_equals_trl(trl, loss_type):
    """A step of two micro-batches (gradient accumulation): TRL divides each by the tokens of the whole step and sums;
    our per-answer losses, told the step's `mean_length`, average to the same loss."""
    settings = {"beta": 0.04, "loss_type": loss_type, "epsilon_high": 5.0 if loss_type == "cispo" else 0.28,
                "gradient_accumulation_steps": 2}
    base, old, ref, advantages, mask = random_batch(seed=1)
    halves = [slice(0, 3), slice(3, 8)]  # unequal micro-batches
    tokens = mask.sum().item()
    theirs = sum(trl_loss(trl, settings, base[h], old[h], ref[h], advantages[h], mask[h], num_items=tokens)
                 for h in halves)
    loss = ours(settings)
    losses = torch.cat([loss(base[h], old[h], ref[h], advantages[h], mask[h], mean_length=tokens / len(mask))[0]
                        for h in halves])
    torch.testing.assert_close(losses.mean(), theirs, atol=1e-6, rtol=0)
    # without it, each micro-batch counts its own tokens: TRL's bnpo, not dapo
    alone = torch.cat([loss(base[h], old[h], ref[h], advantages[h], mask[h])[0] for h in halves])
    assert abs(alone.mean().item() - theirs.item()) > 1e-4


def test_default_is_grpo_with_the_papers_settings():
    "The defaults are unchanged: loss_type grpo, symmetric clip 0.2, beta 0.04, token-level ratio, plain k3."
    loss = GRPOLoss()
    assert (loss.loss_type, loss.epsilon, loss.epsilon_high, loss.kl_coeff) == ("grpo", 0.2, 0.2, 0.04)
    assert loss.importance_sampling_level == "token" and not loss.use_bias_correction_kl


@pytest.mark.parametrize("kwargs, words", [
    (dict(loss_type="gpro"), ["unknown loss_type 'gpro'", "grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"]),
    (dict(importance_sampling_level="answer"), ["'answer'", "'token'", "'sequence'"]),
    (dict(loss_type="dr_grpo"), ["max_completion_length", "max_new_tokens"]),
    (dict(loss_type="cispo"), ["epsilon_high", "5.0"]),
])
def test_bad_settings_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError) as error:
        GRPOLoss(**kwargs)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message
