"""KL penalty: per-token estimators, coefficient controllers and where the penalty is placed.

Estimators (kind ``kl``) map the sampled tokens' log-probabilities under the policy (``logprobs``, [B, T])
and the reference (``ref_logprobs``, [B, T]) to a per-token estimate of KL(π‖π_ref), [B, T]. With
log r = logprobs − ref_logprobs (sources: J. Schulman, "Approximating KL Divergence", 2020, k1/k2/k3; and
"A Comedy of Estimators", arXiv 2512.21852, for how each behaves as a gradient):

    kl  (k1)  log r                       unbiased value, high variance, can be negative
    abs       |log r|                     biased value
    mse (k2)  ½ (log r)²                  biased value, low variance
    k3        exp(−log r) − 1 + log r     unbiased value, low variance, never negative
    full      Σ_v π(v) (log π(v) − log π_ref(v))   exact per position, from full logits
    none      0

Controllers (kind ``kl_controller``) are classes ``Controller(coef, target=None, horizon=10000)``.
Placements (kind ``kl_placement``) are registered as ready-made *instances* (they hold no state), so
``get("kl_placement", "reward").shape_rewards(...)`` works without constructing anything.

Which estimator × placement pairs give an unbiased gradient of the reverse KL is tabulated in
``REVERSE_KL_GRADIENT_UNBIASED`` at the end of this file (checked by exact enumeration in tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlhf_lab.ops import masked_mean
from rlhf_lab.registry import register

# --------------------------------------------------------------------------------------------------
# Estimators: estimator(logprobs, ref_logprobs, logits=None, ref_logits=None) -> [B, T]
# --------------------------------------------------------------------------------------------------


@register("kl", "kl")
def k1(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """k1 = log r = log π(x) − log π_ref(x) (Schulman 2020). Unbiased for KL(π‖π_ref) when x ~ π."""
    return logprobs - ref_logprobs


@register("kl", "abs")
def absolute(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """|log r| = |log π(x) − log π_ref(x)| (arXiv 2512.21852). Biased: overestimates the KL."""
    return (logprobs - ref_logprobs).abs()


@register("kl", "mse")
def k2(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """k2 = ½ (log r)² (Schulman 2020). Biased (second-order accurate as π → π_ref), low variance."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register("kl", "k3")
def k3(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """k3 = exp(−log r) − 1 + log r = (π_ref/π − 1) − log(π_ref/π) (Schulman 2020). Unbiased, ≥ 0."""
    log_ratio = logprobs - ref_logprobs
    return torch.exp(-log_ratio) - 1.0 + log_ratio


@register("kl", "full")
def full(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """Exact Σ_v π(v)(log π(v) − log π_ref(v)) per position from ``logits``/``ref_logits`` [B, T, V].

    Ignores the sampled tokens' log-probs except to check the shape; differentiable w.r.t. ``logits``.
    """
    if logits is None or ref_logits is None:
        raise ValueError(
            "KL estimator 'full' needs the full-vocabulary logits of both models: got "
            f"logits={'None' if logits is None else tuple(logits.shape)}, "
            f"ref_logits={'None' if ref_logits is None else tuple(ref_logits.shape)}"
        )
    if logits.shape[:-1] != logprobs.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match logprobs {tuple(logprobs.shape)} [B, T]")
    return exact_kl(logits, ref_logits)


full.needs_logits = True  # the trainer keeps the reference logits for the update only for such estimators


@register("kl", "none")
def no_kl(
    logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None
) -> Tensor:
    """No KL penalty: zeros shaped like ``logprobs``."""
    return torch.zeros_like(logprobs)


# --------------------------------------------------------------------------------------------------
# Exact KL from full logits, chunked
# --------------------------------------------------------------------------------------------------


def _row_blocks(*tensors: Tensor) -> list[tuple[Tensor, ...]]:
    """Matching 2-D [rows, V] views of [B, T, V] tensors, without copying.

    One block [B·T, V] when every tensor can be viewed that way; otherwise (e.g. a slice along T of a
    longer [B, T_full, V] tensor) one [T, V] block per batch element. Row order is (b, t) either way.
    """
    try:
        return [tuple(tensor.view(-1, tensor.shape[-1]) for tensor in tensors)]
    except RuntimeError:
        return list(zip(*(tensor.unbind(0) for tensor in tensors)))


def _probs_and_log_ratio(logits_rows: Tensor, ref_rows: Tensor) -> tuple[Tensor, Tensor]:
    """p = softmax(z) and log p − log q for [rows, V] chunks, in at least float32, with few temporaries."""
    compute_dtype = torch.promote_types(logits_rows.dtype, torch.float32)
    log_ratio = logits_rows.to(compute_dtype).log_softmax(-1)  # log p for now
    p = log_ratio.exp()
    log_ratio -= ref_rows.to(compute_dtype).log_softmax(-1)
    return p, log_ratio


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[r, v]·b[r, v] per row, without a [rows, V] temporary: [rows, V] × 2 -> [rows]."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).reshape(a.shape[0])


class _ExactKL(torch.autograd.Function):
    """KL(softmax(z)‖softmax(w)) per row with a hand-written, equally chunked backward.

    Autograd through a plain chunk loop would save every chunk's float32 log-softmax for backward, i.e.
    the whole [B, T, V] tensor; here only the inputs are kept and the backward recomputes per chunk:
        ∂KL/∂z_j = p_j (log p_j − log q_j − KL),   ∂KL/∂w_j = q_j − p_j,   p = softmax(z), q = softmax(w).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ref_logits: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits, ref_logits)
        ctx.chunk_size = chunk_size
        pieces = []
        for logits_block, ref_block in _row_blocks(logits, ref_logits):
            for start in range(0, logits_block.shape[0], chunk_size):
                stop = start + chunk_size
                p, log_ratio = _probs_and_log_ratio(logits_block[start:stop], ref_block[start:stop])
                pieces.append(_row_dot(p, log_ratio))
        return torch.cat(pieces).reshape(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        logits, ref_logits = ctx.saved_tensors
        need_logits_grad, need_ref_grad = ctx.needs_input_grad[:2]
        # Fresh contiguous tensors (every row gets written): they split into blocks like the inputs.
        grad_logits = (
            torch.empty_like(logits, memory_format=torch.contiguous_format) if need_logits_grad else None
        )
        grad_ref = (
            torch.empty_like(ref_logits, memory_format=torch.contiguous_format) if need_ref_grad else None
        )
        grad_rows = grad_kl.reshape(-1)
        blocks = _row_blocks(*(t for t in (logits, ref_logits, grad_logits, grad_ref) if t is not None))
        offset = 0
        for logits_block, ref_block, *grad_blocks in blocks:
            grad_logits_block = grad_blocks.pop(0) if need_logits_grad else None
            grad_ref_block = grad_blocks.pop(0) if need_ref_grad else None
            for start in range(0, logits_block.shape[0], ctx.chunk_size):
                stop = start + ctx.chunk_size
                p, log_ratio = _probs_and_log_ratio(logits_block[start:stop], ref_block[start:stop])
                upstream = grad_rows[offset : offset + p.shape[0], None].to(p.dtype)  # [rows, 1]
                offset += p.shape[0]
                if grad_ref_block is not None:  # (q − p)·upstream
                    q = ref_block[start:stop].to(p.dtype).softmax(-1)
                    grad_ref_block[start:stop] = q.sub_(p).mul_(upstream)
                if grad_logits_block is not None:  # p·(log p − log q − KL)·upstream, in place
                    kl = _row_dot(p, log_ratio)[:, None]
                    grad_logits_block[start:stop] = log_ratio.sub_(kl).mul_(p).mul_(upstream)
        return grad_logits, grad_ref, None


def exact_kl(logits: Tensor, ref_logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Exact per-position KL(π‖π_ref) = Σ_v π(v)(log π(v) − log π_ref(v)): [B, T, V] × 2 -> [B, T].

    π = softmax(logits), π_ref = softmax(ref_logits), computed in float32 (or float64 if given) over at
    most ``chunk_size`` rows at a time, so the [B, T, V] float32 log-softmaxes are never materialised
    whole, in forward or backward. Differentiable w.r.t. ``logits`` (and ``ref_logits``).
    """
    if logits.dim() != 3 or logits.shape != ref_logits.shape:
        raise ValueError(
            f"exact_kl needs logits and ref_logits of the same shape [B, T, V]; got {tuple(logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows; got {chunk_size}")
    return _ExactKL.apply(logits, ref_logits, chunk_size)


# --------------------------------------------------------------------------------------------------
# Coefficient controllers: Controller(coef, target=None, horizon=10000)
# --------------------------------------------------------------------------------------------------


@register("kl_controller", "fixed")
class FixedKLController:
    """Constant coefficient β; ``update`` is a no-op (``target`` and ``horizon`` are ignored)."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


@register("kl_controller", "adaptive")
class AdaptiveKLController(FixedKLController):
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2):

        e = clip(KL_current / KL_target − 1, −0.2, 0.2),    β ← β · (1 + e · n_steps / horizon)

    ``n_steps`` is the number of samples (episodes) the KL was measured over, ``horizon`` in the same unit.
    """

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        if target is None or not target > 0 or not math.isfinite(target):
            raise ValueError(f"adaptive KL controller needs a positive kl target; got target={target!r}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller needs a positive horizon; got horizon={horizon!r}")
        super().__init__(coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL: current_kl={current_kl}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + proportional_error * n_steps / self.horizon


# --------------------------------------------------------------------------------------------------
# Placement: where the penalty acts. Registered as instances.
# --------------------------------------------------------------------------------------------------


class RewardPlacement:
    """PPO-style: subtract coef·KL per token from the reward; no gradient flows through the estimate."""

    needs_grad = False

    def reward_penalty(self, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """coef · kl.detach() · mask, the per-token amount taken out of the rewards ([B, T]; 0 where masked,
        even if kl is inf there)."""
        kl_on_response = torch.where(mask > 0, kl.detach(), torch.zeros_like(kl))
        return coef * kl_on_response * mask

    def shape_rewards(self, token_rewards: Tensor, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """token_rewards − :meth:`reward_penalty`."""
        return token_rewards - self.reward_penalty(kl, coef, mask)

    def loss_term(self, kl: Tensor, mask: Tensor, coef: float | Tensor) -> Tensor:
        """Zero scalar on ``kl``'s device and dtype: the penalty already acts through the rewards."""
        return kl.new_zeros(())


class LossPlacement:
    """GRPO-style: add coef · masked_mean(KL) to the loss, with gradient through the estimate."""

    needs_grad = True

    def reward_penalty(self, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """Zeros [B, T]: the penalty acts through ``loss_term``."""
        return torch.zeros_like(mask)

    def shape_rewards(self, token_rewards: Tensor, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """Rewards unchanged: the penalty acts through ``loss_term``."""
        return token_rewards

    def loss_term(self, kl: Tensor, mask: Tensor, coef: float | Tensor) -> Tensor:
        """coef · Σ kl·mask / Σ mask (scalar, differentiable)."""
        kl_on_response = torch.where(mask > 0, kl, torch.zeros_like(kl))
        return coef * masked_mean(kl_on_response, mask)


register("kl_placement", "reward")(RewardPlacement())
register("kl_placement", "loss")(LossPlacement())


# --------------------------------------------------------------------------------------------------
# Which pairs give an unbiased gradient of the reverse KL?
# --------------------------------------------------------------------------------------------------
# On-policy x ~ π_θ, l(x) = log π(x) − log π_ref(x). The target is
#     ∇ KL(π‖π_ref) = ∇ Σ_x π l = Σ_x π ∇log π · l + Σ_x π ∇log π = E_π[l ∇log π]     (as E_π[∇log π] = 0).
# reward placement: reward −f(x), no gradient through f; REINFORCE's expected gradient of the penalty is
#     E_π[f(x) ∇log π(x)].
# loss placement: the sample carries no gradient, the estimate does (through log π(x)); expected gradient
#     E_π[∇f(x)] = E_π[f'(l) ∇log π(x)].
# The table is this single-step (per-position, prefix held fixed) statement. For whole sequences the KL at
# position t also depends on earlier tokens through the prefix; only k1 in the reward with the penalties
# summed into the return-to-go (γ = 1, as PPO/REINFORCE returns do) carries that dependence, so it is the
# one pair here unbiased for the sequence-level KL. k2 and full in the loss give the per-position gradient
# with the prefix held fixed (the same as k1 in the reward with immediate penalties only); tests check this.
REVERSE_KL_GRADIENT_UNBIASED: dict[tuple[str, str], bool] = {
    # k1, reward: E[l ∇log π] — exactly the target.
    ("kl", "reward"): True,
    # k1, loss: f' = 1, E[∇log π] = 0 — no KL gradient at all in expectation.
    ("kl", "loss"): False,
    # abs, reward: E[|l| ∇log π] ≠ E[l ∇log π] whenever some sampled l < 0.
    ("abs", "reward"): False,
    # abs, loss: E[sign(l) ∇log π] — neither KL's gradient.
    ("abs", "loss"): False,
    # k2, reward: E[½ l² ∇log π] — the gradient of a different functional.
    ("mse", "reward"): False,
    # k2, loss: f' = l, E[l ∇log π] — exactly the target (the GRPO-style choice that is correct).
    ("mse", "loss"): True,
    # k3, reward: E[(π_ref/π − 1 + l) ∇log π] = Σ π_ref ∇log π + ∇KL = ∇KL(π‖π_ref) − ∇KL(π_ref‖π).
    ("k3", "reward"): False,
    # k3, loss: f' = 1 − π_ref/π, E = −Σ π_ref ∇log π = ∇KL(π_ref‖π): the FORWARD KL's gradient.
    ("k3", "loss"): False,
    # full, reward: the value is the same whichever token was sampled, so E[c ∇log π] = c·0 = 0 at that
    # position (it only reaches earlier tokens through the return-to-go).
    ("full", "reward"): False,
    # full, loss: the exact KL, differentiated exactly.
    ("full", "loss"): True,
    # none: no penalty, no KL gradient — not applicable, recorded as False.
    ("none", "reward"): False,
    ("none", "loss"): False,
}
