"""The training pass's logits in the LM head's dtype where only the log-prob gather reads them: the same
log-probs and gradients bit for bit, and the cases that keep float32."""

from __future__ import annotations

import pytest
import torch
from conftest import SCORED_PROMPT, SCORED_RESPONSE, scoring_batch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.kl.placements import KLPenalty
from rlhf_lab.models import loading as models
from rlhf_lab.registry import get
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.step.update import Updater

PROMPT, RESPONSE = SCORED_PROMPT, SCORED_RESPONSE


def log_probs_and_gradients(model, float32: bool, share_prompts: bool):
    input_ids, mask = scoring_batch(500)
    model.zero_grad(set_to_none=True)
    with Precision("bf16-mixed", "cpu").autocast():
        logits, _ = response_logits(model, input_ids, mask, PROMPT, 1.0, share_prompts=share_prompts,
                                    float32=float32)
    logprobs = gather_logprobs(logits, input_ids[:, PROMPT:])
    (logprobs * torch.linspace(1, 2, RESPONSE)).sum().backward()
    return logits, logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("share_prompts", [True, False])
def test_bf16_logits_give_the_float32_pass_s_log_probs_and_gradients(compose, tiny_overrides, tiny_tokenizer,
                                                                    share_prompts):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    wide, wide_logprobs, wide_grads = log_probs_and_gradients(model, True, share_prompts)
    narrow, narrow_logprobs, narrow_grads = log_probs_and_gradients(model, False, share_prompts)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(narrow.float(), wide)  # the float32 logits are the bf16 ones' exact copy
    assert torch.equal(narrow_logprobs, wide_logprobs)
    for name, grad in wide_grads.items():
        assert torch.equal(grad, narrow_grads[name]), name


def test_temperature_keeps_float32(compose, tiny_overrides, tiny_tokenizer):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    input_ids, mask = scoring_batch(500)
    with torch.no_grad(), Precision("bf16-mixed", "cpu").autocast():
        logits, _ = response_logits(model, input_ids, mask, PROMPT, 0.7, float32=False)
    assert logits.dtype == torch.float32  # logits / 0.7 are not bf16 numbers


@pytest.mark.parametrize(("overrides", "float32"), [
    ([], False),  # GRPO, k3 in the loss: only the gather reads the logits
    (["algorithm.entropy_coef=0.01"], True),  # the entropy bonus reads them
    (["trainer.temperature=0.7"], True),
    (["kl=full", "kl.placement=loss"], True),  # the exact KL in the loss reads them
])
def test_which_runs_get_the_lm_head_s_logits(compose, tiny_overrides, tiny_tokenizer, overrides, float32):
    cfg = compose([*tiny_overrides(None), "algorithm=grpo", "kl=k3", "kl.placement=loss", *overrides])
    model = models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0)
    updater = Updater(cfg, model, get("algorithm", cfg.algorithm.name)(cfg.algorithm), KLPenalty(cfg.kl),
                      torch.device("cpu"), Precision("bf16-mixed", "cpu"))
    assert updater.logits_float32 is float32
