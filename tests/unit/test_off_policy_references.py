"""The off-policy corrections (``algorithm.tis_mode``, ``policy_loss=dppo``, ``algorithm.off_policy_mask``, the KL's
``token_ratio``) against the implementations they are read from: verl's rollout correction (token and sequence TIS,
Geo-RS), AReaL's decoupled PPO and M2PO, slime's IcePop, prime-rl's default loss, TRL's DeepSeek-V3.2 options.

``references/off_policy.json`` holds each reference's loss and gradient on one input (float64), computed by running
the named function at the named commit, arithmetic unchanged; its ``source`` says which. Here the same batch goes
through the trainer's own pieces — :meth:`Algorithm.importance_weights`, :meth:`Algorithm.training_batch`'s
rejection, :meth:`Algorithm.loss` with the mini-batch's token count, :class:`KLPenalty` — and both must agree to
float64 rounding.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

import rlhf_lab.components  # noqa: F401  (registers losses, estimators, corrections)
from rlhf_lab.algorithms.base import Algorithm, LossContext, PolicyOutput
from rlhf_lab.config.schema import GRPOConfig
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.kl import KLPenalty

REFERENCES = json.loads((Path(__file__).parent / "references" / "off_policy.json").read_text())
DOUBLE = torch.float64


def tensor(name: str) -> torch.Tensor:
    return torch.tensor(REFERENCES["input"][name], dtype=DOUBLE)


def algorithm(options: dict) -> Algorithm:
    keys = {key: value for key, value in options.items() if key in GRPOConfig.__dataclass_fields__}
    cfg = OmegaConf.structured(GRPOConfig(name="grpo", advantage="grpo", clip_eps=REFERENCES["clip_eps"], **keys))
    return Algorithm(cfg)


def rollout(options: dict) -> Rollout:
    mask = tensor("mask")
    rows, width = mask.shape
    sampler = None if options.get("no_sampler_logprobs") else tensor("rollout_logprobs")
    return Rollout(input_ids=torch.zeros(rows, width + 1, dtype=torch.long),
                   attention_mask=torch.cat([torch.ones(rows, 1, dtype=torch.long), mask.long()], 1),
                   response_mask=mask, prompt_width=1, group_size=1, logprobs=tensor("old_logprobs"),
                   entropy=torch.zeros_like(mask), sampler_logprobs=sampler, advantages=tensor("advantages"),
                   ref_logprobs=tensor("ref_logprobs"))


def trainer_loss(options: dict) -> tuple[torch.Tensor, torch.Tensor, Rollout]:
    """(loss, d loss / d logprobs, the training batch) of the reference's input through the trainer's pieces."""
    method = algorithm(options)
    batch = rollout(options)
    weights, _ = method.importance_weights(batch)
    batch = replace(batch, tis_weights=weights)
    keep = method.rejection(batch)
    if keep is not None:
        batch = replace(batch, response_mask=batch.response_mask * keep)
    logprobs = tensor("logprobs").requires_grad_()
    tokens = float(batch.response_mask.sum())
    context = LossContext(minibatch_tokens=tokens, minibatch_rows=len(batch.response_mask))
    loss = method.loss(batch, PolicyOutput(logprobs, logprobs[..., None], None), context).loss
    if "kl" in options:
        kl_options = {"off_policy_correction": options["kl_off_policy_correction"]}
        penalty = KLPenalty(SimpleNamespace(name=options["kl"], placement="loss",
                                            get=lambda key, default=None: kl_options.get(key, default)))
        loss = loss + penalty.loss_term(logprobs, None, batch, options["kl_coef"],
                                        reduce=lambda values, mask: (values * mask).sum() / tokens)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return loss, gradient, batch


@pytest.mark.parametrize("case", REFERENCES["cases"], ids=[case["name"] for case in REFERENCES["cases"]])
def test_each_correction_equals_its_reference(case: dict) -> None:
    loss, gradient, _ = trainer_loss(case["options"])
    torch.testing.assert_close(loss, torch.tensor(case["loss"], dtype=DOUBLE), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gradient, torch.tensor(case["grad_logprobs"], dtype=DOUBLE), rtol=1e-10, atol=1e-14)


def test_the_references_bind_where_the_cases_say() -> None:
    """The fixtures exercise each rule: IcePop's band zeroes a token on each side, Geo-RS keeps only the first
    sequence (geometric means 0.882, 1.457, 0.592 of π_old/μ against [0.6, 1.2]), M2PO drops the three tokens of
    largest (log π_old/μ)² (0.36, 1.21, 1.21: mean of the 9 is 0.329, of the other 6 is 0.0025 < 0.04)."""
    by_name = {case["name"]: case["options"] for case in REFERENCES["cases"]}
    method = algorithm(by_name["IcePop, band [0.5, 2]"])
    weights, stats = method.importance_weights(rollout(by_name["IcePop, band [0.5, 2]"]))
    assert weights[1, 1] == 0 and weights[2, 0] == 0  # π_old/μ = e^1.1 = 3.00 above, e^−1.1 = 0.333 below
    assert stats["rollout/is_capped_frac"] == pytest.approx(2 / 9)
    _, _, batch = trainer_loss(by_name["geometric-mean sequence rejection (Geo-RS), band [0.6, 1.2]"])
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    _, _, batch = trainer_loss(by_name["M2PO, tau 0.04, behaviour weight cap 5"])
    assert batch.response_mask.tolist() == [[1, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 0]]


def test_the_off_policy_sequence_mask_by_hand() -> None:
    """δ = 0.1: row 0 (A < 0, mean log μ − log π = (0.3 + 0.1) / 2 = 0.2 > δ) masked; row 1 (A < 0, mean 0.05) kept;
    row 2 (A > 0, mean 0.5) kept — the positive samples always stay; the padding does not count in the mean."""
    from rlhf_lab.algorithms.off_policy import off_policy_sequence_mask

    logprobs = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=DOUBLE)
    behaviour = torch.tensor([[-0.7, -0.9, 0.0], [-0.95, -1.0, -0.95], [-0.5, -0.5, -0.5]], dtype=DOUBLE)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=DOUBLE)
    advantages = torch.tensor([[-1.0] * 3, [-1.0] * 3, [1.0] * 3], dtype=DOUBLE)
    keep = off_policy_sequence_mask(logprobs, behaviour, advantages, mask, 0.1)
    assert keep.tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1]]


@pytest.mark.extra("trl")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_off_policy_sequence_mask_is_trl_s(seed: int) -> None:
    """On random ragged batches where it binds, the mask equals TRL's ``GRPOTrainer.get_off_policy_mask`` (called).
    Importing TRL sets ``VLLM_LOGGING_LEVEL`` in the process environment: put back after it."""
    with mock.patch.dict(os.environ):
        from trl.trainer.grpo_trainer import GRPOTrainer

    from rlhf_lab.algorithms.off_policy import off_policy_sequence_mask

    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(16, 7, generator=generator, dtype=DOUBLE) * 3
    behaviour = logprobs + torch.randn(16, 7, generator=generator, dtype=DOUBLE) * 0.5
    lengths = torch.randint(1, 8, (16,), generator=generator)
    mask = (torch.arange(7)[None] < lengths[:, None]).to(DOUBLE)
    advantages = torch.randn(16, 1, generator=generator, dtype=DOUBLE)
    theirs = GRPOTrainer.get_off_policy_mask(advantages, logprobs, behaviour, mask, 0.1)
    ours = off_policy_sequence_mask(logprobs, behaviour, advantages.expand_as(mask), mask, 0.1)
    assert 0 < int((theirs == 0).sum()) < 16  # it binds on some rows, not all
    torch.testing.assert_close(ours, theirs.expand_as(mask), rtol=0, atol=0)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["algorithm.tis_mode=icepop"], "algorithm.tis_mode=icepop needs algorithm.tis_cap"),
    (["algorithm.tis_mode=m2po"], "algorithm.tis_mode=m2po needs algorithm.tis_cap"),
    (["algorithm.tis_cap=2", "algorithm.tis_floor=0.5"], "tis_mode=token_truncate has none: use tis_mode icepop or geo_mask"),
    (["algorithm.tis_mode=icepop", "algorithm.tis_cap=2", "algorithm.tis_floor=3"], "must be in (0, algorithm.tis_cap=2"),
    (["algorithm.tis_mode=m2po", "algorithm.tis_cap=5", "algorithm.m2po_tau=0"], "algorithm.m2po_tau=0"),
    (["algorithm.off_policy_mask=-0.1"], "algorithm.off_policy_mask=-0.1"),
    (["algorithm.dppo_tau=-1"], "algorithm.dppo_tau=-1"),
    (["algorithm.tis_mode=vespo"], "algorithm.tis_mode"),
])
def test_bad_off_policy_settings_are_one_line(overrides: list[str], expected: str) -> None:
    from rlhf_lab.config import ConfigError, compose

    with pytest.raises(ConfigError) as raised:
        compose(["model=tiny", *overrides])
    assert expected in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("overrides", [
    ["algorithm.tis_mode=icepop", "algorithm.tis_cap=5", "algorithm.tis_floor=0.5"],
    ["algorithm.tis_mode=geo_mask", "algorithm.tis_cap=1.001"],
    ["algorithm.tis_mode=m2po", "algorithm.tis_cap=5", "algorithm.m2po_tau=0.04"],
    ["algorithm.policy_loss=dppo", "algorithm.off_policy_mask=0.1", "kl.off_policy_correction=token_ratio"],
])
def test_the_corrections_compose(overrides: list[str]) -> None:
    from rlhf_lab.config import compose

    cfg = compose(["model=tiny", *overrides])
    assert {key.split("=")[0].split(".")[-1] for key in overrides if key.startswith("algorithm.")} <= set(cfg.algorithm)
