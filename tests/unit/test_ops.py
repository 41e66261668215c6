"""gather_logprobs: its hand-written in-place backward gives autograd's gradient bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.scoring.logprobs import gather_logprobs, scale_logits


def autograd_reference(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """token logit − logsumexp per row chunk, differentiated by autograd (the formula gather_logprobs uses)."""
    flat_logits, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = flat_logits[start : start + chunk_size].float()
        picked = rows.gather(-1, flat_tokens[start : start + chunk_size, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(pieces).reshape(tokens.shape)


@pytest.mark.parametrize(("dtype", "chunk_size"), [(torch.float32, 1024), (torch.float32, 5), (torch.bfloat16, 7)])
def test_gradient_is_autograd_s_bit_for_bit(dtype: torch.dtype, chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=generator) * 4).to(dtype).requires_grad_()
    tokens = torch.randint(0, 50, (3, 7), generator=generator)
    weights = torch.randn(3, 7, generator=generator)  # upstream gradients of both signs
    want = autograd_reference(logits, tokens, chunk_size)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    got = gather_logprobs(logits, tokens, chunk_size)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    assert torch.equal(got, want)
    assert got_grad.dtype == dtype
    assert torch.equal(got_grad, want_grad)
    # and it is log softmax at the token, with ∂/∂z = g·(onehot − softmax)
    log_softmax = logits.float().log_softmax(-1)
    torch.testing.assert_close(got, log_softmax.gather(-1, tokens[..., None]).squeeze(-1), rtol=0, atol=1e-5)
    expected = weights[..., None] * (torch.nn.functional.one_hot(tokens, 50) - log_softmax.exp())
    torch.testing.assert_close(got_grad.float(), expected.detach(), rtol=0, atol=2e-2 if dtype == torch.bfloat16
                               else 1e-6)


def test_without_gradient_it_keeps_nothing() -> None:
    logits = torch.randn(2, 3, 11)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        values = gather_logprobs(logits, tokens)
    assert values.grad_fn is None
    assert torch.equal(values, autograd_reference(logits, tokens, 1024))


def test_scale_logits_skips_the_division_at_temperature_one() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert scale_logits(logits, 1.0) is logits  # float32 in, nothing allocated
    assert torch.equal(scale_logits(logits, 1.0), logits / 1.0)  # x / 1 is x exactly
    assert torch.equal(scale_logits(logits, 0.7), logits / 0.7)
    half = logits.bfloat16()
    assert scale_logits(half, 1.0).dtype == torch.float32
    assert torch.equal(scale_logits(half, 1.0), half.float())


def test_float64_logits_keep_float64_through_log_probs_entropy_and_gradient() -> None:
    """A float64 run is not rounded to float32 on the way: log-probs, entropy and the gradient agree with float64
    autograd to 1e-12 (float32 would leave ~1e-7)."""
    from rlhf_lab.scoring.logprobs import entropy_from_logits

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 40, generator=generator, dtype=torch.float64) * 4).requires_grad_()
    tokens = torch.randint(0, 40, (2, 5), generator=generator)
    weights = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    got = gather_logprobs(logits, tokens, 3)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    log_softmax = logits.log_softmax(-1)
    want = log_softmax.gather(-1, tokens[..., None]).squeeze(-1)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    assert got.dtype == got_grad.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)
    entropy = entropy_from_logits(logits.detach(), 3)
    assert entropy.dtype == torch.float64
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach(), rtol=0, atol=1e-12)
    assert scale_logits(logits, 0.7).dtype == torch.float64
    assert scale_logits(logits.to(torch.bfloat16), 1.0).dtype == torch.float32
