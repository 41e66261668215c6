"""Scoring passes attend with the grouped key/value heads as they are (``hardware.grouped_kv``): the
same logits bit for bit as transformers' repeated heads, gradients equal to float rounding, and the repeated
copies no longer kept for the backward pass."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import SCORED_GROUP, SCORED_PROMPT, SCORED_RESPONSE, scoring_batch

from rlhf_lab.hardware.grouped_kv import GROUPED_KV_SWITCH, grouped_kv_attention
from rlhf_lab.models import loading as models
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import response_logits

PROMPT, RESPONSE, GROUP = SCORED_PROMPT, SCORED_RESPONSE, SCORED_GROUP


@pytest.fixture
def model(compose, tiny_overrides, tiny_tokenizer):
    cfg = compose(tiny_overrides(None))
    model = models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads
    return model


def scoring_pass(model, precision: str, share_prompts: bool):
    """Logits, every gradient by name, and the elements the pass keeps for its backward pass."""
    input_ids, mask = scoring_batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t), \
            Precision(precision, "cpu").autocast(), grouped_kv_attention(model, torch.device("cpu")):
        logits, _ = response_logits(model, input_ids, mask, PROMPT, 1.0, share_prompts=share_prompts)
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, sum(kept)


def repeated_heads_elements(model, share_prompts: bool) -> int:
    """What transformers' repeated keys and values add over the grouped ones, per pass: 2 · B · (H − KV) · S · D
    for every attention call (the shared prompts' prefill and the rows' continuation, or one plain pass)."""
    config = model.config
    extra_heads = config.num_attention_heads - config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    calls = [(2, PROMPT), (2 * GROUP, PROMPT + RESPONSE - 1)] if share_prompts else [(2 * GROUP, PROMPT + RESPONSE)]
    return config.num_hidden_layers * sum(2 * rows * extra_heads * keys * head_dim for rows, keys in calls)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_same_logits_close_gradients_without_the_repeated_heads_kept(model, monkeypatch, share_prompts) -> None:
    logits, grads, kept = scoring_pass(model, "fp32", share_prompts)
    monkeypatch.setenv(GROUPED_KV_SWITCH, "0")  # the environment's own setting stands: transformers repeats
    ref_logits, ref_grads, ref_kept = scoring_pass(model, "fp32", share_prompts)
    assert torch.equal(logits, ref_logits)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert ref_kept - kept == repeated_heads_elements(model, share_prompts)


def test_same_logits_under_bf16_autocast(model, monkeypatch) -> None:
    logits, _, _ = scoring_pass(model, "bf16-mixed", True)
    monkeypatch.setenv(GROUPED_KV_SWITCH, "0")
    ref_logits, _, _ = scoring_pass(model, "bf16-mixed", True)
    assert torch.equal(logits, ref_logits)


def test_the_switch_is_on_only_inside_and_only_where_it_applies(model, monkeypatch) -> None:
    monkeypatch.delenv(GROUPED_KV_SWITCH, raising=False)
    with grouped_kv_attention(model, torch.device("cpu")):
        assert os.environ[GROUPED_KV_SWITCH] == "1"
    assert GROUPED_KV_SWITCH not in os.environ
    with pytest.raises(RuntimeError), grouped_kv_attention(model, torch.device("cpu")):
        raise RuntimeError  # a failing pass leaves it off too
    assert GROUPED_KV_SWITCH not in os.environ
    with grouped_kv_attention(model, torch.device("meta")):  # another device: CUDA's kernels want no mask for it
        assert GROUPED_KV_SWITCH not in os.environ
    models.enable_activation_checkpointing(model)  # the backward's recomputation would run outside the context
    with grouped_kv_attention(model, torch.device("cpu")):
        assert GROUPED_KV_SWITCH not in os.environ
    monkeypatch.setenv(GROUPED_KV_SWITCH, "0")
    with grouped_kv_attention(model, torch.device("cpu")):
        assert os.environ[GROUPED_KV_SWITCH] == "0"
    assert os.environ[GROUPED_KV_SWITCH] == "0"
