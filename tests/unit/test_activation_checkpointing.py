"""``trainer.gradient_checkpointing`` turns on transformers' activation checkpointing by its current name: no
deprecation warning in a run's output, with or without LoRA, and the older name where the new one is missing."""

from __future__ import annotations

import warnings

import pytest

from rlhf_lab import models


@pytest.fixture(scope="module")
def tokenizer(compose, tiny_overrides):
    return models.load_tokenizer(compose(tiny_overrides(None)).model)


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_is_on_without_a_future_warning(compose, tiny_overrides, tokenizer, lora: bool) -> None:
    cfg = compose([*tiny_overrides(None), "model.lora.enabled=true", "model.lora.r=4"])
    model = models.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    if lora:
        model = models.apply_lora(model, cfg.model.lora)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.enable_activation_checkpointing(model)
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
