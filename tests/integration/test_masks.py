"""Response masks, positions and token rewards, and proof that prompt and padding tokens never count.

The unit tests check the mask helpers against hand-written tensors. The integration tests build a real
rollout with the tiny model (prompts of different lengths, so rows are left padded; responses cut at an
EOS, so rows have padding after it) and show that the trainer's loss, KL and gradients ignore both kinds
of padding.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from rlhf_lab.algorithms.base import LossContext
from rlhf_lab.data.prompts import format_prompts
from rlhf_lab.generation.hf import generate
from rlhf_lab.generation.rollout import Rollout, response_mask_from_tokens, scores_to_token_rewards
from rlhf_lab.registry import get
from rlhf_lab.scoring.forward import position_ids_from_mask, response_logits
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs
from rlhf_lab.training.loop import Trainer

EOS = 2  # SmolLM2's EOS, which is also its pad token

# ------------------------------------------------------------------------------------------ unit tests


def test_response_mask_keeps_the_first_eos_and_drops_what_follows() -> None:
    response_ids = torch.tensor([
        [5, 6, EOS, 7, 8],  # EOS at 2: keep 0..2
        [5, 6, 7, 8, 9],  # no EOS: all ones
        [EOS, 5, 6, 7, 8],  # EOS first: only the EOS counts
        [5, EOS, EOS, EOS, EOS],  # EOS used as padding after the first one
    ])
    expected = [
        [1.0, 1.0, 1.0, 0.0, 0.0],
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 0.0, 0.0, 0.0],
    ]
    mask = response_mask_from_tokens(response_ids, EOS)
    assert mask.dtype == torch.float32
    assert mask.tolist() == expected


def test_response_mask_with_several_eos_ids_and_with_none() -> None:
    response_ids = torch.tensor([[5, 9, 6, EOS], [5, 6, 7, 8]])
    assert response_mask_from_tokens(response_ids, [EOS, 9]).tolist() == [[1.0, 1.0, 0.0, 0.0], [1.0] * 4]
    assert response_mask_from_tokens(response_ids, None).tolist() == [[1.0] * 4, [1.0] * 4]


def test_position_ids_skip_left_padding() -> None:
    attention_mask = torch.tensor([
        [0, 0, 1, 1, 1, 1],  # two pads, then positions 0..3
        [1, 1, 1, 1, 1, 1],  # no padding
        [0, 1, 1, 1, 0, 0],  # one pad, then 0..2, then masked tail (positions stay at the last value)
    ])
    expected = [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 2, 2]]
    assert position_ids_from_mask(attention_mask).tolist() == expected


def test_scores_land_on_the_last_valid_token() -> None:
    scores = torch.tensor([2.0, -1.0, 0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    expected = [[0.0, 0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, -1.0], [0.5, 0.0, 0.0, 0.0, 0.0]]
    assert scores_to_token_rewards(scores, mask).tolist() == expected


# ----------------------------------------------------------------------------------- a real rollout

PROMPTS = ["Hi", "Write two honest sentences about a slow but beautiful film about the sea and its sailors."]
GROUP_SIZE = 2
# First EOS of each response row (None: no EOS, the row runs to max_new_tokens).
EOS_AT = [2, None, 0, 4]
SCORES = torch.tensor([1.0, -0.5, 0.25, 2.0])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, compose, tiny_overrides) -> Trainer:
    tmp = tmp_path_factory.mktemp("masks")
    cfg = compose([*tiny_overrides(tmp), "trainer.max_new_tokens=6", "kl=full", "kl.placement=loss",
                   "kl.coef=0.5", "algorithm.entropy_coef=0.01"])
    trainer = Trainer(cfg, tmp / "run")
    # Move the policy away from the reference so KL terms and ratios are not trivially 0 and 1.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in trainer.policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trainer


def sample(trainer: Trainer, temperature: float = 1.0, top_k: int = 0, share_prompts: bool = True) -> Rollout:
    formatted = format_prompts(PROMPTS, trainer.tokenizer, True, None)
    torch.manual_seed(0)
    return generate(trainer.policy, trainer.tokenizer, formatted, group_size=GROUP_SIZE, max_new_tokens=6,
                    temperature=temperature, top_p=1.0, top_k=top_k, max_prompt_tokens=256, keep_logits=True,
                    share_prompts=share_prompts)


def cut_at_eos(rollout: Rollout, eos_at: list[int | None], after_eos: torch.Tensor | None = None) -> Rollout:
    """The rollout with response row i ending in an EOS at ``eos_at[i]``; what follows is ``after_eos``
    (default: the pad token, as generation leaves it)."""
    response_ids = rollout.response_ids.clone()
    for row, position in enumerate(eos_at):
        if position is not None:
            response_ids[row, position] = EOS
            response_ids[row, position + 1 :] = EOS
    response_mask = response_mask_from_tokens(response_ids, EOS)
    if after_eos is not None:
        response_ids = torch.where(response_mask.bool(), response_ids, after_eos)
    prompt_mask = rollout.attention_mask[:, : rollout.prompt_width]
    return Rollout(
        input_ids=torch.cat([rollout.input_ids[:, : rollout.prompt_width], response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=response_mask,
        prompt_width=rollout.prompt_width,
        group_size=rollout.group_size,
        logprobs=rollout.logprobs,
        entropy=rollout.entropy,
    )


def score(trainer: Trainer, rollout: Rollout) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """Fill every per-token quantity as ``Trainer.train_step`` does; return (rollout, KL estimate, exact KL).

    The "old" log-probs are the reference's, so the ratio π/π_old differs from 1 and the clip is exercised.
    """
    mask = rollout.response_mask
    with torch.no_grad():
        policy_logits, _ = response_logits(trainer.policy, rollout.input_ids, rollout.attention_mask,
                                           rollout.prompt_width, 1.0)
        with trainer.models.reference_context():
            ref_logits, _ = response_logits(trainer.models.reference_model(), rollout.input_ids,
                                            rollout.attention_mask, rollout.prompt_width, 1.0)
    ref_logprobs = gather_logprobs(ref_logits, rollout.response_ids) * mask
    rollout = replace(rollout, policy_logits=policy_logits, ref_logits=ref_logits, ref_logprobs=ref_logprobs,
                      logprobs=ref_logprobs.clone(), entropy=entropy_from_logits(policy_logits) * mask,
                      scores=SCORES.clone())
    estimate, exact = trainer.kl.sampled_terms(rollout)
    rollout = replace(rollout, kl_penalty=trainer.kl.placement.reward_penalty(estimate, trainer.kl_controller.coef,
                                                                              mask))
    rollout, _ = trainer.algorithm.prepare(rollout)
    return rollout, estimate, exact


def trainer_loss(trainer: Trainer, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logits) of the whole rollout as one mini-batch, through ``Updater.micro_loss``."""
    captured = []
    forward = trainer.updater.forward

    def forward_keeping_logits(batch: Rollout):
        output = forward(batch)
        output.logits.retain_grad()
        captured.append(output)
        return output

    trainer.updater.forward = forward_keeping_logits
    try:
        context = LossContext(float(rollout.response_mask.sum()), rollout.batch_size)
        loss = trainer.updater.micro_loss(rollout, context, trainer.kl_controller.coef).loss
        trainer.policy.zero_grad(set_to_none=True)
        loss.backward()
    finally:
        del trainer.updater.forward
    trainer.policy.zero_grad(set_to_none=True)
    return loss.detach(), captured[0].logits.grad


@pytest.fixture(scope="module")
def rollouts(trainer: Trainer) -> tuple[Rollout, Rollout]:
    """The same responses twice: once with pad tokens where generation puts them, once with random token
    ids at every left-padding and post-EOS position."""
    base = sample(trainer)
    clean = cut_at_eos(base, EOS_AT)
    generator = torch.Generator().manual_seed(2)
    vocab = len(trainer.tokenizer)
    scrambled = cut_at_eos(base, EOS_AT, after_eos=torch.randint(3, vocab, clean.response_ids.shape,
                                                                 generator=generator))
    prompt_ids = scrambled.input_ids[:, : base.prompt_width]
    left_padding = base.attention_mask[:, : base.prompt_width] == 0
    noise = torch.randint(3, vocab, prompt_ids.shape, generator=generator)
    scrambled.input_ids[:, : base.prompt_width] = torch.where(left_padding, noise, prompt_ids)
    return clean, scrambled


def test_the_rollout_has_both_kinds_of_padding(rollouts: tuple[Rollout, Rollout]) -> None:
    clean, scrambled = rollouts
    prompt_mask = clean.attention_mask[:, : clean.prompt_width]
    assert (prompt_mask[0] == 0).sum() > 5  # "Hi" is left padded (rows 0, 1 share that prompt)
    assert (prompt_mask[2] == 0).sum() == 0  # the long prompt is not
    assert clean.response_mask.sum(-1).tolist() == [3.0, 6.0, 1.0, 5.0]
    changed = clean.input_ids != scrambled.input_ids
    assert changed.sum() > 10
    # Only padding changed: nothing the attention mask lets through.
    assert not (changed & clean.attention_mask.bool()).any()


def test_padding_tokens_change_neither_loss_nor_kl(trainer: Trainer, rollouts: tuple[Rollout, Rollout]) -> None:
    clean, estimate, exact = score(trainer, copy.deepcopy(rollouts[0]))
    scrambled, scrambled_estimate, scrambled_exact = score(trainer, copy.deepcopy(rollouts[1]))
    mask = clean.response_mask.bool()
    assert exact[mask].min() > 1e-4  # the policy really differs from the reference
    torch.testing.assert_close(scrambled_exact[mask], exact[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scrambled_estimate[mask], estimate[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scrambled.ref_logprobs, clean.ref_logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scrambled.advantages, clean.advantages, rtol=1e-5, atol=1e-6)
    loss, _ = trainer_loss(trainer, clean)
    scrambled_loss, _ = trainer_loss(trainer, scrambled)
    assert loss.abs() > 1e-3
    torch.testing.assert_close(scrambled_loss, loss, rtol=1e-5, atol=1e-7)

    # The check can fail: changing one real prompt token does change the loss.
    touched = copy.deepcopy(rollouts[0])
    touched.input_ids[2, 3] = (touched.input_ids[2, 3] + 1) % len(trainer.tokenizer)
    touched_loss, _ = trainer_loss(trainer, score(trainer, touched)[0])
    assert abs((touched_loss - loss).item()) > 1e-6


def test_no_gradient_reaches_masked_logits(trainer: Trainer, rollouts: tuple[Rollout, Rollout]) -> None:
    rollout, _, _ = score(trainer, copy.deepcopy(rollouts[0]))
    mask = rollout.response_mask.bool().clone()
    assert (~mask).sum() == 9  # 24 response positions, 3 + 6 + 1 + 5 = 15 valid
    _, logits_grad = trainer_loss(trainer, rollout)
    assert logits_grad.shape[:2] == mask.shape
    assert torch.all(logits_grad[~mask] == 0)  # exactly zero, not merely small
    assert torch.all(logits_grad[mask].abs().sum(-1) > 0)  # every valid position gets a gradient


def test_kl_in_the_reward_leaves_masked_positions_at_zero(trainer: Trainer,
                                                          rollouts: tuple[Rollout, Rollout]) -> None:
    rollout, _, _ = score(trainer, copy.deepcopy(rollouts[0]))
    mask = rollout.response_mask
    # The raw per-position KL is nonzero after the EOS too (the logits exist there); add an inf to be sure.
    raw_kl = trainer.kl.estimator(rollout.logprobs, rollout.ref_logprobs, logits=rollout.policy_logits,
                                  ref_logits=rollout.ref_logits)
    assert (raw_kl[mask == 0] > 1e-4).all()
    raw_kl[0, -1] = float("inf")
    coef = 0.1
    placement = get("kl_placement", "reward")
    shaped = placement.shape_rewards(scores_to_token_rewards(rollout.scores, mask), raw_kl, coef, mask)
    assert torch.all(shaped[mask == 0] == 0)
    # Valid positions: −0.1·KL, plus the score on the last valid token (row 0 ends at index 2).
    expected_row0 = [-coef * raw_kl[0, 0].item(), -coef * raw_kl[0, 1].item(), 1.0 - coef * raw_kl[0, 2].item()]
    assert shaped[0, :3].tolist() == pytest.approx(expected_row0, rel=1e-6)
    assert placement.loss_term(raw_kl, mask, coef).item() == 0.0
    rollout, _ = trainer.algorithm.prepare(replace(rollout, kl_penalty=placement.reward_penalty(raw_kl, coef, mask)))
    torch.testing.assert_close(rollout.token_rewards, shaped)
    assert torch.all(rollout.advantages[mask == 0] == 0)
    assert torch.isfinite(rollout.advantages).all()


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 50)])
def test_generation_logprobs_match_a_plain_forward_pass(trainer: Trainer, temperature: float, top_k: int) -> None:
    """The decode's log-probs are of the distribution each token was drawn from: softmax(logits / T), or under
    top-k its truncation to the k most likely tokens, renormalised (vLLM's processed log-probs); its entropy and
    logits are the policy's, softmax(logits / T), either way."""
    rollout = sample(trainer, temperature=temperature, top_k=top_k)
    assert (rollout.attention_mask[:, : rollout.prompt_width] == 0).any()  # left padding present
    with torch.no_grad():
        logits, _ = response_logits(trainer.policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width,
                                    temperature, share_prompts=False)
    mask = rollout.response_mask.bool()
    plain = gather_logprobs(logits, rollout.response_ids)
    kept = logits >= logits.topk(top_k, dim=-1).values[..., -1:] if top_k else torch.ones_like(logits, dtype=torch.bool)
    logprobs = gather_logprobs(logits.masked_fill(~kept, float("-inf")), rollout.response_ids)
    torch.testing.assert_close(rollout.logprobs[mask], logprobs[mask], rtol=0, atol=1e-4)
    if top_k:  # the kept mass's log, log Z < 0, is added back: q's log-probs are above the policy's
        assert bool((logprobs - plain)[mask].gt(1e-3).all())
    torch.testing.assert_close(rollout.entropy[mask], entropy_from_logits(logits)[mask], rtol=0, atol=1e-4)
    torch.testing.assert_close(rollout.policy_logits[mask], logits[mask], rtol=0, atol=1e-4)


def test_shared_prompt_prefill_samples_what_the_unshared_generation_samples(trainer: Trainer) -> None:
    """Prefilling each prompt once and repeating its cache changes no sample and no log-prob."""
    shared, plain = sample(trainer, share_prompts=True), sample(trainer, share_prompts=False)
    assert (shared.attention_mask[:, : shared.prompt_width] == 0).any()  # a left-padded prompt is shared too
    assert torch.equal(shared.input_ids, plain.input_ids) and torch.equal(shared.response_mask, plain.response_mask)
    mask = plain.response_mask.bool()
    torch.testing.assert_close(shared.logprobs[mask], plain.logprobs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.policy_logits[mask], plain.policy_logits[mask], rtol=0, atol=1e-4)
