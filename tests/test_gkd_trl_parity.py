"""`GeneralizedJSDLoss` against TRL's own GKD loss (trl 1.16, a dev dependency): the loss and its gradient with respect
to the student's logits equal `trl.experimental.gkd.GKDTrainer.generalized_jsd_loss` on the same random logits and
masked labels within 1e-6, for beta in {0, 0.1, 0.5, 0.9, 1} and four temperatures; the sum divided by a step's token
count equals TRL's `num_items_in_batch` form; the chunked loss agrees; and TRL's whole `compute_loss` (its shift of
the labels, run on a stand-in trainer) equals our loss on labels shifted as the KD recipe shifts them. As in the
distillation chapter (nbs/61_kd_losses.ipynb)."""
import types
import warnings

import pytest
import torch

from torchtune_lit.modules.loss.kd_losses import (
    GeneralizedJSDLoss,
    GeneralizedJSDWithChunkedOutputLoss,
)

TRL_MISSING = "trl is not importable (a dev dependency: pip install trl==1.16.0)"


@pytest.fixture(scope="module")
def gkd():
    "TRL's GKDTrainer (imported once: the import takes seconds)."
    try:
        with warnings.catch_warnings():  # TRL marks trl.experimental as unstable
            warnings.simplefilter("ignore")
            from trl.experimental.gkd import GKDTrainer
    except ImportError as error:
        pytest.skip(f"{TRL_MISSING}: {error}")
    return GKDTrainer


def random_logits(seed: int, batch: int = 3, length: int = 12, vocab: int = 40):
    "Student and (sharper) teacher logits; labels with a masked prompt and padding."
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, length, vocab, generator=generator)
    teacher = 2 * torch.randn(batch, length, vocab, generator=generator)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    labels[0, :4] = -100
    labels[1, 9:] = -100
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 3.0])
def test_loss_and_gradient_equal_trl(gkd, beta, temperature):
    student, teacher, labels = random_logits(seed=int(beta * 10 + temperature * 100))
    ours_in, theirs_in = student.clone().requires_grad_(), student.clone().requires_grad_()
    ours = GeneralizedJSDLoss(beta, temperature)(ours_in, teacher, labels)
    theirs = gkd.generalized_jsd_loss(theirs_in, teacher, labels, beta=beta,
                                      temperature=temperature)
    (ours + theirs).backward()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, atol=1e-6, rtol=0)


def test_the_betas_differ():
    "The parity above is not vacuous: on the same logits, each beta gives its own loss."
    student, teacher, labels = random_logits(seed=0)
    values = [GeneralizedJSDLoss(beta)(student, teacher, labels).item() for beta in (0.0, 0.1, 0.5, 0.9, 1.0)]
    assert len({round(v, 5) for v in values}) == 5, values


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_sum_over_a_steps_tokens_equals_trl_num_items(gkd, beta):
    "Gradient accumulation: TRL divides a micro-batch's sum by the step's tokens; normalize=False gives the sum."
    student, teacher, labels = random_logits(seed=3)
    tokens = 50  # the trained tokens of the whole step, more than this micro-batch's
    ours = GeneralizedJSDLoss(beta)(student, teacher, labels, normalize=False) / tokens
    theirs = gkd.generalized_jsd_loss(student, teacher, labels, beta=beta, num_items_in_batch=torch.tensor(tokens))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_chunked_equals_trl(gkd):
    student, teacher, labels = random_logits(seed=4, length=13)
    chunked = GeneralizedJSDWithChunkedOutputLoss(4, beta=0.3, temperature=1.5)
    ours = chunked(list(student.tensor_split(4, 1)), list(teacher.tensor_split(4, 1)), labels)
    theirs = gkd.generalized_jsd_loss(student, teacher, labels, beta=0.3, temperature=1.5)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_compute_loss_with_its_label_shift_equals_ours(gkd):
    """TRL's compute_loss takes unshifted labels (-100 on the prompt) and shifts them; the KD recipe's labels are
    already shifted (label t is token t + 1). Same loss."""
    generator = torch.Generator().manual_seed(5)
    student_logits, teacher_logits = torch.randn(2, 10, 30, generator=generator), torch.randn(2, 10, 30, generator=generator)
    input_ids = torch.randint(0, 30, (2, 10), generator=generator)
    labels = input_ids.clone()
    labels[0, :3], labels[1, :6], labels[1, 8:] = -100, -100, -100  # prompts, padding

    def model_returning(logits):
        return lambda input_ids, attention_mask: types.SimpleNamespace(logits=logits)

    teacher = model_returning(teacher_logits)
    teacher.eval = lambda: None
    trainer = types.SimpleNamespace(teacher_model=teacher, beta=0.5,
                                    generalized_jsd_loss=gkd.generalized_jsd_loss)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    theirs = gkd.compute_loss(trainer, model_returning(student_logits), inputs)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    ours = GeneralizedJSDLoss(0.5)(student_logits, teacher_logits, shifted)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(beta=1.5), ["beta", "[0, 1]", "1.5"]),
    (dict(temperature=0.0), ["temperature", "> 0"]),
])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError) as error:
        GeneralizedJSDLoss(**kwargs)
    assert all(w in str(error.value) for w in words), str(error.value)
