"""Selective activation recomputation (``trainer.recompute``, rlhf_lab/models/recompute.py): the same gradients bit for
bit, fewer tensors kept for the backward pass, which parts a config picks, and one-line errors."""

from __future__ import annotations

import pytest
import torch
from conftest import SCORED_PROMPT, SCORED_RESPONSE, scoring_batch

from rlhf_lab.errors import ConfigError
from rlhf_lab.models import loading as models
from rlhf_lab.models.recompute import AUTO, recompute_modules, recomputing
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs

PROMPT, RESPONSE = SCORED_PROMPT, SCORED_RESPONSE


def tiny_cfg(compose, tiny_overrides, *overrides: str):
    return compose([*tiny_overrides(None), *overrides])


def tiny_policy(cfg, tokenizer):
    model = models.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    return models.apply_lora(model, cfg.model.lora) if cfg.model.lora.enabled else model


def training_pass(model, modules, precision: str, saved: list[torch.Tensor] | None = None):
    """Loss over the response log-probs and the last hidden states (PPO's value input); gradients by name."""
    input_ids, mask = scoring_batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # LoRA dropout draws
    pack = (lambda t: saved.append(t) or t) if saved is not None else (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recomputing(modules):
        with Precision(precision, "cpu").autocast():
            logits, hidden = response_logits(model, input_ids, mask, PROMPT, 1.0, output_hidden_states=True)
        loss = gather_logprobs(logits, input_ids[:, PROMPT:]).sum() + hidden.float().square().mean()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.dropout=0.3"]


@pytest.mark.parametrize(("precision", "overrides"), [
    ("fp32", []),
    ("bf16-mixed", []),
    ("fp32", [*LORA, "trainer.recompute=[input_layernorm,post_attention_layernorm,mlp]"]),  # named: off by default
])
def test_gradients_equal_the_plain_pass_bit_for_bit(compose, tiny_overrides, tiny_tokenizer, precision, overrides):
    cfg = tiny_cfg(compose, tiny_overrides, *overrides)
    model = tiny_policy(cfg, tiny_tokenizer)
    modules = recompute_modules(model, cfg.trainer, auto=True)
    assert len(modules) == len(AUTO) * cfg.model.tiny.num_hidden_layers
    plain = training_pass(model, [], precision)
    recomputed = training_pass(model, modules, precision)
    assert plain.keys() == recomputed.keys() and len(plain) > 0
    for name, grad in plain.items():
        assert torch.equal(grad, recomputed[name]), name


def test_the_mlp_s_activations_are_not_kept(compose, tiny_overrides, tiny_tokenizer):
    cfg = tiny_cfg(compose, tiny_overrides, "trainer.recompute=[mlp]")
    model = tiny_policy(cfg, tiny_tokenizer)
    width = cfg.model.tiny.intermediate_size

    def kept_widths(modules) -> list[int]:
        saved: list[torch.Tensor] = []
        training_pass(model, modules, "fp32", saved)
        return [t.shape[-1] for t in saved if t.dim() >= 2 and t.shape[-1] == width]

    # gate, up, their product and the activation: 4 per layer, plus the MLP weights' [H, I] ones kept either way
    plain, recomputed = kept_widths([]), kept_widths(recompute_modules(model, cfg.trainer, auto=True))
    assert len(plain) - len(recomputed) >= 3 * cfg.model.tiny.num_hidden_layers
    assert len(recomputed) <= cfg.model.tiny.num_hidden_layers  # down_proj's weight [H, I] only


def test_wrapping_lasts_only_for_the_block_and_keeps_an_instance_forward(compose, tiny_overrides, tiny_tokenizer):
    cfg = tiny_cfg(compose, tiny_overrides)
    model = tiny_policy(cfg, tiny_tokenizer)
    modules = recompute_modules(model, cfg.trainer, auto=True)
    hooked = modules[0]
    own_forward = hooked.forward  # as accelerate's hooks set one on the instance
    hooked.forward = own_forward
    with recomputing(modules):
        assert all("forward" in m.__dict__ for m in modules)
        assert hooked.forward is not own_forward
    assert hooked.forward is own_forward
    assert all("forward" not in m.__dict__ for m in modules[1:])
    with torch.no_grad(), recomputing(modules):  # nothing is kept without gradients: nothing to wrap
        assert all("forward" not in m.__dict__ for m in modules[1:])


def test_which_parts_a_config_picks(compose, tiny_overrides, tiny_tokenizer):
    model = tiny_policy(tiny_cfg(compose, tiny_overrides), tiny_tokenizer)
    layers = model.model.layers

    def picked(*overrides: str, auto: bool = True):
        return recompute_modules(model, tiny_cfg(compose, tiny_overrides, *overrides).trainer, auto=auto)

    assert picked() == [getattr(layer, name) for layer in layers for name in AUTO]  # hardware=cpu_tuned's choice
    assert picked(auto=False) == []  # the plain path's
    assert picked("trainer.recompute=[mlp]", auto=False) == [layer.mlp for layer in layers]
    assert picked("trainer.recompute=[]") == []
    assert picked("trainer.recompute=[mlp]") == [layer.mlp for layer in layers]
    assert picked("trainer.recompute=[mlp,mlp]") == [layer.mlp for layer in layers]
    assert picked("trainer.gradient_checkpointing=true") == []  # whole layers are recomputed there
    lora = tiny_policy(tiny_cfg(compose, tiny_overrides, *LORA), tiny_tokenizer)
    assert recompute_modules(lora, tiny_cfg(compose, tiny_overrides, *LORA).trainer, auto=True) == []  # under LoRA
    named = recompute_modules(lora, tiny_cfg(compose, tiny_overrides, *LORA, "trainer.recompute=[mlp]").trainer)
    assert named == [layer.mlp for layer in lora.base_model.model.model.layers]


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.recompute=[mlpp]"],
     "trainer.recompute: 'mlpp' is not a submodule of every decoder layer; valid names: mlp, input_layernorm, "
     "post_attention_layernorm (or [] for none)"),
    (["trainer.recompute=[self_attn]"],
     "trainer.recompute: 'self_attn' takes the key/value cache; valid names: mlp, input_layernorm, "
     "post_attention_layernorm (or [] for none)"),
])
def test_bad_choices_are_one_line_errors(compose, tiny_overrides, tiny_tokenizer, overrides, message):
    cfg = tiny_cfg(compose, tiny_overrides, *overrides)
    with pytest.raises(ConfigError) as error:
        recompute_modules(tiny_policy(cfg, tiny_tokenizer), cfg.trainer)
    assert str(error.value) == message


def test_parts_beside_whole_layer_checkpointing_stop_the_config_before_a_model_loads(compose, tiny_overrides):
    message = ("trainer.recompute=['mlp']: trainer.gradient_checkpointing already recomputes whole layers; set "
               "trainer.recompute=[] or trainer.gradient_checkpointing=false")
    with pytest.raises(ConfigError) as error:
        tiny_cfg(compose, tiny_overrides, "trainer.recompute=[mlp]", "trainer.gradient_checkpointing=true")
    assert str(error.value) == message
    cfg = tiny_cfg(compose, tiny_overrides, "trainer.gradient_checkpointing=true")  # the default: nothing named
    cfg.trainer.recompute = ["mlp"]  # set past the validation (the Python API): the model build says the same
    with pytest.raises(ConfigError) as error:
        recompute_modules(torch.nn.Sequential(), cfg.trainer)
    assert str(error.value) == message


def test_a_model_without_decoder_layers(compose, tiny_overrides):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert recompute_modules(model, tiny_cfg(compose, tiny_overrides).trainer) == []
    with pytest.raises(ConfigError, match=r"^trainer.recompute=\['mlp'\]: the model has no decoder layers"):
        recompute_modules(model, tiny_cfg(compose, tiny_overrides, "trainer.recompute=[mlp]").trainer)


def test_parts_named_beside_layers_checkpointed_by_the_device_s_default_are_one_line(compose, tiny_overrides,
                                                                                     tiny_tokenizer):
    """``trainer.gradient_checkpointing`` null is on under CUDA: the model's checkpointed layers decide, not the
    config's null (the two would nest)."""
    cfg = tiny_cfg(compose, tiny_overrides, "trainer.recompute=[mlp]")
    assert cfg.trainer.gradient_checkpointing is None
    model = tiny_policy(cfg, tiny_tokenizer)
    assert recompute_modules(model, cfg.trainer)  # no layer checkpointed: the MLPs
    models.enable_activation_checkpointing(model)  # as the trainer does under CUDA
    with pytest.raises(ConfigError, match=r"^trainer.recompute=\['mlp'\]: trainer.gradient_checkpointing \(null: on "
                                          r"under CUDA\) already recomputes whole layers"):
        recompute_modules(model, cfg.trainer)
