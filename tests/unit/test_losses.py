"""Policy losses (rlhf_lab/algorithms/losses.py): value and gradient against hand computation, and each loss
against an independent reference written here from its paper's formula on random ragged batches."""

from __future__ import annotations

import math

import pytest
import torch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.algorithms.losses import ClipRange, sampler_correction, truncated_importance_weights
from rlhf_lab.registry import get

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual.detach().double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6,
                               atol=1e-9)


def loss_fn(name: str):
    return get("policy_loss", name)


def test_clip_value_and_where_each_side_binds() -> None:
    # ratios e^{0.5} = 1.6487 (A = 1: clipped high at 1.2, loss −1.2), e^{−0.5} = 0.6065 (A = −1: clipped low at
    # 0.8, loss 0.8), 1 (A = 2: −2); row 1's padding is ignored.
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.5, 0.0], [0.0, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    result = loss_fn("clip")(new, old, advantages, MASK, ClipRange(0.2, 0.2))
    close(result.per_token, [[-1.2, 0.8, -2.0], [-3.0, 0.0, 0.0]])
    assert result.events["clipped_high"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert result.events["clipped_low"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    result.per_token.sum().backward()
    # Clipped tokens carry no gradient; the others −A·r: −2·1 and −3·1.
    close(new.grad, [[0.0, 0.0, -2.0], [-3.0, 0.0, 0.0]])


def test_dual_clip_bounds_negative_advantage_losses() -> None:
    # A = −1 with ratio e^{1.5} = 4.48: PPO's loss is max(4.48, 1.2) = 4.48; Dual-clip c = 3 caps it at 3 and
    # takes its gradient away. A = −1 at ratio 2 (loss 2 < 3) is untouched; positive advantages never are.
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[1.5, math.log(2.0), 1.5]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    result = loss_fn("clip")(new, old, advantages, torch.ones(1, 3, dtype=torch.float64), ClipRange(0.2, 0.2, 3.0))
    close(result.per_token, [[3.0, 2.0, -1.2]])
    assert result.events["dual_clipped"].tolist() == [[1.0, 0.0, 0.0]]
    result.per_token.sum().backward()
    close(new.grad, [[0.0, 2.0, 0.0]])



def test_dual_clip_bounds_the_unclipped_ratio_loss_too() -> None:
    # clip_eps null (the reinforce and rloo presets): loss −A·r. A = −1 at ratio e^{1.5} = 4.48 is capped at c = 3
    # (no gradient); A = −1 at ratio 2 keeps −A·r = 2 and its gradient r·(−A) = 2; A = 1 at 4.48 is never bounded.
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[1.5, math.log(2.0), 1.5]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    result = loss_fn("clip")(new, old, advantages, torch.ones(1, 3, dtype=torch.float64), ClipRange(None, None, 3.0))
    close(result.per_token, [[3.0, 2.0, -math.exp(1.5)]])
    assert result.events == {"dual_clipped": result.events["dual_clipped"]}
    assert result.events["dual_clipped"].tolist() == [[1.0, 0.0, 0.0]]
    result.per_token.sum().backward()
    close(new.grad, [[0.0, 2.0, -math.exp(1.5)]])
    # Without c the same inputs give −A·r everywhere.
    plain = loss_fn("clip")(new, old, advantages, torch.ones(1, 3, dtype=torch.float64), ClipRange(None, None))
    close(plain.per_token, [[math.exp(1.5), 2.0, -math.exp(1.5)]])
    assert plain.events == {}


def test_gspo_uses_the_length_normalised_sequence_ratio() -> None:
    # Row 0: log-ratios [0.3, 0.1, −0.1] -> mean 0.1, s = e^{0.1} = 1.10517 for every token (ε 0.2: unclipped);
    # row 1: one token, log-ratio 0.5 -> s = 1.6487, clipped at 1.2 with A = 1.
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.3, 0.1, -0.1], [0.5, 7.0, 7.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64) * MASK
    result = loss_fn("gspo")(new, old, advantages, MASK, ClipRange(0.2, 0.2))
    s = math.exp(0.1)
    assert result.per_token[0].tolist() == pytest.approx([-2 * s] * 3)
    assert result.per_token[1, 0].item() == pytest.approx(-1.2)
    assert result.ratio[0].tolist() == pytest.approx([s] * 3)
    result.per_token.sum().backward()
    # d(−A·s_t)/d log π_t = −A·s (the stop-gradient form), row 1 clipped: 0.
    assert new.grad[0].tolist() == pytest.approx([-2 * s] * 3)
    assert new.grad[1].tolist() == [0.0, 0.0, 0.0]


def test_cispo_keeps_every_gradient_with_a_clipped_stopped_weight() -> None:
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    result = loss_fn("cispo")(new, old, advantages, torch.ones(1, 3, dtype=torch.float64), ClipRange(0.2, 0.2))
    # Weights clip(3, 0.8, 1.2) = 1.2, clip(0.5) = 0.8, 1: loss −w·A·log π; gradient −w·A (no token loses it).
    weights = [1.2, 0.8, 1.0]
    expected = [-w * a * lp for w, a, lp in zip(weights, [1.0, -2.0, 0.5], [math.log(3.0), math.log(0.5), 0.0])]
    assert result.per_token[0].tolist() == pytest.approx(expected)
    result.per_token.sum().backward()
    assert new.grad[0].tolist() == pytest.approx([-1.2, 1.6, -0.5])
    assert result.events["clipped_high"].tolist() == [[1.0, 0.0, 0.0]]
    assert result.events["clipped_low"].tolist() == [[0.0, 1.0, 0.0]]


def test_reinforce_loss_has_no_ratio() -> None:
    new = torch.tensor([[-0.7, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[5.0, -9.0]], dtype=torch.float64)  # irrelevant
    result = loss_fn("reinforce")(new, old, torch.tensor([[2.0, -1.0]], dtype=torch.float64),
                                  torch.ones(1, 2, dtype=torch.float64), ClipRange())
    close(result.per_token, [[1.4, -2.0]])
    result.per_token.sum().backward()
    close(new.grad, [[-2.0, 1.0]])


def test_truncated_importance_weights_cap_the_ratio() -> None:
    train = torch.tensor([[0.0, math.log(5.0), math.log(0.5)]])
    sampler = torch.zeros(1, 3)
    close(truncated_importance_weights(train, sampler, cap=2.0), [[1.0, 2.0, 0.5]])


# --------------------------------------------------------------------------- independent references
def reference_clip(new, old, adv, mask, low, high):
    out = torch.zeros_like(new)
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if mask[b, t]:
                r = math.exp(new[b, t] - old[b, t])
                out[b, t] = max(-adv[b, t] * r, -adv[b, t] * min(max(r, 1 - low), 1 + high))
    return out


def reference_gspo(new, old, adv, mask, low, high):
    out = torch.zeros_like(new)
    for b in range(new.shape[0]):
        n = int(mask[b].sum())
        s = math.exp(sum(float(new[b, t] - old[b, t]) for t in range(n)) / max(n, 1))
        for t in range(n):
            out[b, t] = max(-adv[b, t] * s, -adv[b, t] * min(max(s, 1 - low), 1 + high))
    return out


def reference_cispo(new, old, adv, mask, low, high):
    out = torch.zeros_like(new)
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if mask[b, t]:
                w = min(max(math.exp(new[b, t] - old[b, t]), 1 - low), 1 + high)
                out[b, t] = -w * adv[b, t] * new[b, t]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "reference"), [("clip", reference_clip), ("gspo", reference_gspo),
                                                 ("cispo", reference_cispo)])
def test_each_loss_matches_its_reference_on_random_ragged_batches(seed: int, name: str, reference) -> None:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (4,), generator=generator)
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()
    old = -torch.rand(4, 5, generator=generator, dtype=torch.float64) * 3
    new = old + (torch.rand(4, 5, generator=generator, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    if name == "gspo":
        adv = adv[:, :1].expand(4, 5).clone()  # sequence-level advantages
    result = loss_fn(name)(new * mask, old * mask, adv * mask, mask, ClipRange(0.1, 0.15))
    expected = reference(new * mask, old * mask, adv * mask, mask, 0.1, 0.15)
    torch.testing.assert_close(result.per_token, expected, rtol=0, atol=1e-6)


def test_sampler_corrections_by_hand() -> None:
    """Token ratios r = [2, 0.5, 4] (log-ratios ln 2, −ln 2, ln 4), cap 3; the sequence's ratio is 2·0.5·4 = 4."""
    sampler = torch.zeros(1, 3)
    train = torch.tensor([[math.log(2.0), -math.log(2.0), math.log(4.0)]])
    mask = torch.ones(1, 3)
    close(sampler_correction(train, sampler, mask, 3.0, "token_truncate"), [[2.0, 0.5, 3.0]])
    close(sampler_correction(train, sampler, mask, 3.0, "token_mask"), [[2.0, 0.5, 0.0]])
    close(sampler_correction(train, sampler, mask, 3.0, "sequence_truncate"), [[3.0, 3.0, 3.0]])
    close(sampler_correction(train, sampler, mask, 3.0, "sequence_mask"), [[0.0, 0.0, 0.0]])
    close(sampler_correction(train, sampler, mask, 5.0, "sequence_mask"), [[4.0, 4.0, 4.0]])
    padded = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: out of the product, weight 0
    close(sampler_correction(train, sampler, padded, 3.0, "sequence_truncate"), [[1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="algorithm.tis_mode='tokens'; valid: token_truncate, token_mask"):
        sampler_correction(train, sampler, mask, 3.0, "tokens")
