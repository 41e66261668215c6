"""The decode loop's sampler makes ``torch.multinomial``'s draws: the same exponential numbers from the same
generator state, bit for bit, and the same token per row."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab import sampler
from rlhf_lab.sampler import exponential_draws, sample_tokens

SHAPE = (4, 50_000)  # 200,000 draws per seed


def _reference_draws(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    draws = torch.empty(shape).exponential_()
    return draws, torch.get_rng_state()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exponential_draws_are_exponential_s_numbers_and_advance_the_generator_alike(seed: int) -> None:
    expected, expected_state = _reference_draws(seed, SHAPE)
    torch.manual_seed(seed)
    draws = exponential_draws(SHAPE)
    assert draws.dtype == torch.float32 and draws.shape == SHAPE
    assert torch.equal(draws.view(torch.int32), expected.view(torch.int32))  # bit patterns, signed zeros included
    assert torch.equal(torch.get_rng_state(), expected_state)


def test_the_c_library_path_gives_the_same_numbers(monkeypatch) -> None:
    # A margin this wide sends ~1 draw in 200 through math.log1p: the recomputed ones must be exact too.
    monkeypatch.setattr(sampler, "_UNSURE", 2.0**-30)
    recomputed = []
    c_log1p = sampler.math.log1p
    monkeypatch.setattr(sampler.math, "log1p", lambda x: recomputed.append(x) or c_log1p(x))
    expected, expected_state = _reference_draws(7, SHAPE)
    torch.manual_seed(7)
    draws = exponential_draws(SHAPE)
    assert len(recomputed) > 100
    assert torch.equal(draws.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(torch.get_rng_state(), expected_state)


def test_a_zero_draw_is_positive_zero_as_exponential_makes_it(monkeypatch) -> None:
    # u = 0 gives −log1p(−0) = +0: p / +0 is +inf (a token multinomial picks), never −inf.
    real_empty = torch.empty

    def zero_uniform(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        tensor.uniform_ = lambda: tensor.zero_()  # type: ignore[method-assign]
        return tensor

    monkeypatch.setattr(sampler.torch, "empty", zero_uniform)
    draws = exponential_draws((4, 1001))  # vectorised blocks and a scalar tail
    assert torch.equal(draws.view(torch.int32), torch.zeros(4, 1001, dtype=torch.int32))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sample_tokens_draws_multinomial_s_tokens(seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(16, 3000, generator=generator) * 4
    logits[:8, 1000:] = float("-inf")  # truncated rows (top-k / top-p): zero probabilities
    probs = torch.softmax(logits, dim=-1)
    torch.manual_seed(seed)
    expected = torch.multinomial(probs, num_samples=1).squeeze(1)
    expected_state = torch.get_rng_state()
    torch.manual_seed(seed)
    tokens = sample_tokens(probs)
    assert torch.equal(tokens, expected)
    assert torch.equal(torch.get_rng_state(), expected_state)
    assert bool((tokens[:8] < 1000).all())


@pytest.mark.parametrize(("bad", "message"), [(float("nan"), "probability tensor contains"),
                                              (-0.5, "probability tensor contains"),
                                              (0.0, "invalid multinomial distribution")])
def test_invalid_rows_are_refused_as_multinomial_refuses_them_without_drawing(bad: float, message: str) -> None:
    probs = torch.full((2, 5), 0.2)
    probs[1] = 0.0 if bad == 0.0 else probs[1]
    probs[1, 2] = bad
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=message):
        sample_tokens(probs)
    assert torch.equal(torch.get_rng_state(), state)


def test_other_dtypes_go_to_multinomial() -> None:
    probs = torch.softmax(torch.randn(3, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), -1)
    torch.manual_seed(5)
    expected = torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(5)
    assert torch.equal(sample_tokens(probs), expected)
