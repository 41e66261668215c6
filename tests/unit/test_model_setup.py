"""Model set-up: LoRA wrapping (the policy's and the reward model's adapters come from one place, which keeps
peft's deprecation noise out of a run's output without hiding any other warning) and activation checkpointing
(``trainer.gradient_checkpointing``) by transformers' current name."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.models import loading as models
from rlhf_lab.offline.reward_model import build_reward_model

DEPRECATION = "`is_gradient_checkpointing` is deprecated and will be removed in v6."


def lora_cfg(compose, tiny_overrides, *overrides: str):
    return compose([*tiny_overrides(None), "model.lora.enabled=true", "model.lora.r=4", *overrides])


def recorded(action) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return caught


def test_apply_lora_raises_no_future_warning_and_trains_only_the_adapter(compose, tiny_overrides, tiny_tokenizer):
    cfg = lora_cfg(compose, tiny_overrides)
    wrapped = []
    caught = recorded(lambda: wrapped.append(models.apply_lora(
        models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0), cfg.model.lora)))
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    trainable = [name for name, p in wrapped[0].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_peft_wrapping_silences_only_that_warning_and_only_inside():
    def warn_both():
        warnings.warn(DEPRECATION, FutureWarning, stacklevel=1)
        warnings.warn("another future change", FutureWarning, stacklevel=1)

    def inside():
        with models.peft_wrapping():
            warn_both()

    assert [str(w.message) for w in recorded(inside)] == ["another future change"]
    assert [str(w.message) for w in recorded(warn_both)] == [DEPRECATION, "another future change"]


def test_the_reward_model_s_lora_goes_through_the_same_wrapping(compose, tiny_overrides, tiny_tokenizer):
    cfg = lora_cfg(compose, tiny_overrides)
    built = []
    caught = recorded(lambda: built.append(build_reward_model(cfg.model, tiny_tokenizer, torch.float32, seed=0)))
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    model = built[0]
    assert model.peft_config["default"].task_type == "SEQ_CLS"
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in name for name in trainable)
    assert any("score" in name for name in trainable)  # peft keeps the new classification head trainable
    out = model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long))
    assert out.logits.shape == (1, 1)


def test_a_reward_model_target_module_that_does_not_exist_is_one_line(compose, tiny_overrides, tiny_tokenizer):
    cfg = lora_cfg(compose, tiny_overrides, "model.lora.target_modules=[q_proj,qkv]")
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: 'qkv' not in the model; valid names: .*q_proj"):
        build_reward_model(cfg.model, tiny_tokenizer, torch.float32, seed=0)


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_is_on_without_a_future_warning(compose, tiny_overrides, tiny_tokenizer, lora: bool) -> None:
    cfg = lora_cfg(compose, tiny_overrides)
    model = models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0)
    if lora:
        model = models.apply_lora(model, cfg.model.lora)
    caught = recorded(lambda: models.enable_activation_checkpointing(model))
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert model.is_activation_checkpointing
    layer = model.get_base_model().model.layers[0] if lora else model.model.layers[0]
    assert layer.gradient_checkpointing


def test_a_transformers_without_the_new_name_gets_the_old_one() -> None:
    calls = []

    class OlderModel:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    models.enable_activation_checkpointing(OlderModel())
    assert calls == [{"use_reentrant": False}]
