"""Offline losses as pure tensor functions: the DPO family (kind ``preference_loss``) and Bradley–Terry.

Every preference loss takes per-pair sequence log-probabilities ([N] each: the sum of the response tokens'
log-probs) of the policy and of the reference, and returns the per-pair loss [N]::

    loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, label_smoothing,
         gamma, chosen_lengths, rejected_lengths) -> Tensor

With the log-ratio margin h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)):
``sigmoid`` −log σ(βh) (with label smoothing ε: cDPO), ``ipo`` (h − 1/(2β))² (summed or per-token log-ratios),
``hinge`` max(0, 1 − βh), ``robust`` the unbiased noisy-label correction, ``simpo`` the reference-free,
length-normalised loss (with label smoothing as cDPO's). Any of them can add the chosen response's NLL.
The implicit rewards logged as ``rewards/chosen`` / ``rewards/rejected`` (TRL's names) are
β (log π − log π_ref), or β · mean token log-prob for the reference-free ``simpo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lab.registry import get, names, register


def log_ratio_margin(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
                     ref_rejected_logps: Tensor) -> Tensor:
    """h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)), per pair [N]."""
    return (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)


@register("preference_loss", "sigmoid")
def sigmoid_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
                 *, beta: float, label_smoothing: float = 0.0, **_: object) -> Tensor:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290): −log σ(βh).

    With ``label_smoothing`` ε > 0 it is conservative DPO (cDPO, Mitchell 2023): each label is wrong with
    probability ε, −(1 − ε) log σ(βh) − ε log σ(−βh).
    """
    h = log_ratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


IPO_NORMALIZE = ("sum", "mean")


@register("preference_loss", "ipo")
def ipo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
             *, beta: float, ipo_normalize: str = "sum", chosen_lengths: Tensor | None = None,
             rejected_lengths: Tensor | None = None, **_: object) -> Tensor:
    """IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17): (h − 1/(2β))², a squared loss that does not push the
    margin to infinity on deterministic preferences (β plays the role of the paper's τ).

    ``ipo_normalize``: ``sum``, h from the summed log-ratios (eq. 17 as written); ``mean``, each response's
    log-ratio divided by its token count first (TRL's ``loss_type="ipo"``), so β does not scale with length.
    """
    if ipo_normalize == "mean":
        h = ((chosen_logps - ref_chosen_logps) / _lengths(chosen_lengths)
             - (rejected_logps - ref_rejected_logps) / _lengths(rejected_lengths))
    else:
        h = log_ratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return (h - 1 / (2 * beta)) ** 2


@register("preference_loss", "hinge")
def hinge_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
               *, beta: float, **_: object) -> Tensor:
    """SLiC-HF's calibration loss (Zhao et al. 2023, arXiv 2305.10425) on the log-ratio margin:
    max(0, 1 − βh)."""
    h = log_ratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return torch.relu(1 - beta * h)


@register("preference_loss", "robust")
def robust_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
                *, beta: float, label_smoothing: float = 0.0, **_: object) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024, arXiv 2403.00409, eq. 9): with labels flipped with probability
    ε < 1/2, the unbiased loss [−(1 − ε) log σ(βh) + ε log σ(−βh)] / (1 − 2ε)."""
    h = log_ratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def _lengths(lengths: Tensor | None) -> Tensor:
    if lengths is None:
        raise ValueError("a length-normalised loss needs the response lengths (chosen_lengths, rejected_lengths)")
    return lengths.clamp(min=1)


def _mean_logps(logps: Tensor, lengths: Tensor | None) -> Tensor:
    return logps / _lengths(lengths)


@register("preference_loss", "simpo")
def simpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor | None = None,
               ref_rejected_logps: Tensor | None = None, *, beta: float, gamma: float = 0.0,
               label_smoothing: float = 0.0, chosen_lengths: Tensor | None = None,
               rejected_lengths: Tensor | None = None, **_: object) -> Tensor:
    """SimPO (Meng et al. 2024, arXiv 2405.14734, eq. 6): reference-free and length-normalised,
    −log σ(z) with z = β/|y_w| log π(y_w) − β/|y_l| log π(y_l) − γ and the target reward margin γ. With
    ``label_smoothing`` ε: −(1 − ε) log σ(z) − ε log σ(−z), as SimPO's own trainer and TRL's CPO."""
    chosen = _mean_logps(chosen_logps, chosen_lengths)
    rejected = _mean_logps(rejected_logps, rejected_lengths)
    z = beta * (chosen - rejected) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


simpo_loss.reference_free = True  # type: ignore[attr-defined]  (no reference pass needed)
for _loss in (sigmoid_loss, robust_loss, simpo_loss):  # the losses that read algorithm.label_smoothing
    _loss.label_smoothing = True  # type: ignore[attr-defined]


def is_reference_free(loss_type: str) -> bool:
    return bool(getattr(get("preference_loss", loss_type), "reference_free", False))


def smoothed_losses() -> list[str]:
    """The registered preference losses that read ``label_smoothing`` (a plug-in's says so by the attribute)."""
    return [name for name in names("preference_loss") if getattr(get("preference_loss", name), "label_smoothing",
                                                                  False)]


@dataclass
class PairLogps:
    """Per-pair quantities of a batch of preference pairs, all [N]."""

    chosen: Tensor  # Σ log π(y_w | x) over the chosen response's tokens
    rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_lengths: Tensor  # response tokens (with EOS)
    rejected_lengths: Tensor


def preference_loss(loss_type: str, logps: PairLogps, beta: float, label_smoothing: float = 0.0,
                    gamma: float = 0.0, ipo_normalize: str = "sum", nll_weight: float = 0.0) -> Tensor:
    """The registered ``preference_loss`` named ``loss_type`` per pair [N], plus ``nll_weight`` times the chosen
    response's mean token NLL (:func:`chosen_nll`) where it is > 0."""
    loss = get("preference_loss", loss_type)(
        logps.chosen, logps.rejected, logps.ref_chosen, logps.ref_rejected, beta=beta,
        label_smoothing=label_smoothing, gamma=gamma, ipo_normalize=ipo_normalize,
        chosen_lengths=logps.chosen_lengths, rejected_lengths=logps.rejected_lengths)
    return loss + nll_weight * chosen_nll(logps) if nll_weight > 0 else loss


def chosen_nll(logps: PairLogps) -> Tensor:
    """−log π(y_w) / |y_w| per pair [N]: the behaviour-cloning term on the chosen response (SimPO's
    ``sft_weight``, CPO's α: TRL's ``cpo_alpha`` and DPO's ``rpo_alpha``, which average over the batch's chosen
    tokens instead, the same where the chosen responses have equal lengths)."""
    return -_mean_logps(logps.chosen, logps.chosen_lengths)


def implicit_rewards(loss_type: str, logps: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) implicit rewards [N]: β (log π − log π_ref); β · mean token log-prob for simpo."""
    if is_reference_free(loss_type):
        return (beta * _mean_logps(logps.chosen, logps.chosen_lengths),
                beta * _mean_logps(logps.rejected, logps.rejected_lengths))
    return beta * (logps.chosen - logps.ref_chosen), beta * (logps.rejected - logps.ref_rejected)


def preference_metrics(loss_type: str, logps: PairLogps, beta: float) -> dict[str, Tensor]:
    """TRL's DPO metrics, summed over the pairs (divide by the pair count for means): ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``."""
    chosen, rejected = implicit_rewards(loss_type, logps, beta)
    return {
        "rewards/chosen": chosen.detach().sum(),
        "rewards/rejected": rejected.detach().sum(),
        "rewards/margins": (chosen - rejected).detach().sum(),
        "rewards/accuracies": (chosen > rejected).float().sum(),
        "logps/chosen": logps.chosen.detach().sum(),
        "logps/rejected": logps.rejected.detach().sum(),
    }


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None,
                       center_coefficient: float = 0.0) -> Tensor:
    """Per-pair Bradley–Terry loss [N] of a scalar reward model (Bradley & Terry 1952; Ouyang et al. 2022):
    −log σ(r_w − r_l − m), with an optional margin m (Llama 2, Touvron et al. 2023), plus
    c · (r_w + r_l)², which keeps rewards centred on zero (TRL's ``center_rewards_coefficient``; Eisenstein
    et al. 2023)."""
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference)
    if center_coefficient:
        loss = loss + center_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return loss
