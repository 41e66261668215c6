"""The decode loop's sampler makes ``torch.multinomial``'s draws: the same exponential numbers from the same
generator state, bit for bit, and the same token per row."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lab.hardware import fast_draws as sampler
from rlhf_lab.hardware.fast_draws import draws_from_uniform, sample_tokens

SHAPE = (4, 50_000)  # 200,000 draws per seed


def exponential_draws(shape: tuple[int, ...]) -> torch.Tensor:
    """What the sampler draws: float64 uniforms from the default generator, made exponential."""
    return draws_from_uniform(torch.empty(shape, dtype=torch.float64).uniform_())


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


def test_a_zero_draw_is_positive_zero_as_exponential_makes_it() -> None:
    # u = 0 gives −log1p(−0) = +0: p / +0 is +inf (a token multinomial picks), never −inf.
    draws = draws_from_uniform(torch.zeros(4, 1001, dtype=torch.float64))  # vectorised blocks and a scalar tail
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


@pytest.mark.parametrize(("seed", "scale"), [(0, 1.0), (1, 4.0), (2, 12.0), (3, 0.05)])
def test_sample_tokens_at_the_embedded_model_s_width_draws_multinomial_s_tokens(seed: int, scale: float) -> None:
    # Flat (scale 0.05) to peaked (12) rows of the embedded model's vocabulary width, 16 rows as a bench step.
    logits = torch.randn(16, 49_152, generator=torch.Generator().manual_seed(200 + seed)) * scale
    probs = torch.softmax(logits, dim=-1)
    for _ in range(3):  # consecutive steps: the generator must stay in step with multinomial's
        state = torch.get_rng_state()
        expected = torch.multinomial(probs, num_samples=1).squeeze(1)
        expected_state = torch.get_rng_state()
        torch.set_rng_state(state)
        assert torch.equal(sample_tokens(probs), expected)
        assert torch.equal(torch.get_rng_state(), expected_state)


def _with_uniforms(monkeypatch, uniform: torch.Tensor) -> None:
    """Make the sampler's ``uniform_`` draw ``uniform`` (float64, the probabilities' shape)."""
    real_empty = torch.empty

    def given_uniform(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        tensor.uniform_ = lambda: tensor.copy_(uniform)  # type: ignore[method-assign]
        return tensor

    monkeypatch.setattr(sampler.torch, "empty", given_uniform)


def _reference_tokens(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """multinomial's rule written out: first argmax of float32 p / float32(−log1p(−u)), log1p the C library's."""
    draws = torch.tensor([[-math.log1p(-u) for u in row] for row in uniform.tolist()], dtype=torch.float32)
    return (probs / draws).argmax(-1)


def test_equal_ratios_give_the_first_token_as_argmax_does(monkeypatch) -> None:
    probs = torch.tensor([[0.1, 0.3, 0.05, 0.3, 0.25], [0.2, 0.2, 0.2, 0.2, 0.2]])
    uniform = torch.full((2, 5), 0.5, dtype=torch.float64)  # one q for every entry: ratios tie with p
    _with_uniforms(monkeypatch, uniform)
    tokens = sample_tokens(probs)
    assert tokens.tolist() == [1, 0]
    assert torch.equal(tokens, _reference_tokens(probs, uniform))


def test_many_near_ties_are_all_weighed_exactly(monkeypatch) -> None:
    # Near-equal p and u: every bound reaches the best exact ratio (q / u = 1.19 at u = 0.3), so all 200 entries
    # of a row are candidates and their exact ratios, 2⁻²¹ apart, decide.
    generator = torch.Generator().manual_seed(3)
    base = torch.full((4, 200), 1 / 200)
    probs = base * (1 + torch.randn(4, 200, generator=generator) * 2.0**-21)
    uniform = (0.3 + torch.randn(4, 200, generator=generator, dtype=torch.float64) * 2.0**-22).clamp(0, 1)
    _with_uniforms(monkeypatch, uniform)
    assert torch.equal(sample_tokens(probs), _reference_tokens(probs, uniform))


@pytest.mark.parametrize(("probs", "uniform", "first"), [
    ([[0.4, 0.0, 0.5, 0.1], [0.1, 0.2, 0.3, 0.4]], [[0.9, 0.2, 0.0, 0.0], [0.7, 0.1, 0.9, 0.2]], 2),  # inf
    ([[0.4, 0.3, 0.0, 0.3], [0.1, 0.2, 0.3, 0.4]], [[0.5, 0.5, 0.0, 0.5], [0.7, 0.1, 0.9, 0.2]], 2),  # NaN
])
def test_zero_draws_give_multinomial_s_inf_and_nan_tokens(monkeypatch, probs, uniform, first) -> None:
    # u = 0 makes q = +0: p / +0 = inf (the first such token wins), and 0 / +0 = NaN, which argmax picks.
    probs, uniform = torch.tensor(probs), torch.tensor(uniform, dtype=torch.float64)
    _with_uniforms(monkeypatch, uniform)
    tokens = sample_tokens(probs)
    assert tokens[0].item() == first
    assert torch.equal(tokens, _reference_tokens(probs, uniform))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_argmax_of_the_few_entries_is_argmax_of_the_whole_row(seed: int) -> None:
    # Entries on a coarse grid so rows tie often; some +inf; the rest of each row is −inf, as argmax would see it.
    generator = torch.Generator().manual_seed(seed)
    shape = torch.Size((12, 300))
    mask = torch.rand(shape, generator=generator) < 0.05
    mask[:, int(torch.randint(0, 300, (1,), generator=generator))] = True  # every row holds one at least
    rows, cols = mask.nonzero(as_tuple=True)
    values = torch.randint(0, 4, (len(rows),), generator=generator).float()
    values[torch.rand(len(rows), generator=generator) < 0.05] = math.inf
    dense = torch.full(shape, -math.inf).index_put_((rows, cols), values)
    assert torch.equal(sampler.first_argmax(values, rows, cols, shape), dense.argmax(-1))
