"""Generation weights (LoRA merged out of place, frozen layers cast once) and frozen weights stored in the
autocast dtype: the same numbers as the layers they stand for, and nothing of the model written."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import rlhf_lab.hardware.generation_weights as gw
from rlhf_lab.generation.hf import generate
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.hardware.generation_weights import generation_weights
from rlhf_lab.models import loading as models
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)
PROMPTS = ["Hi", "Say something kind about the sea."]
SAMPLING = dict(group_size=3, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, max_prompt_tokens=64,
                keep_logits=True)
ROWS = len(PROMPTS) * SAMPLING["group_size"]  # the decode's rows: the packed layouts are made for them


def sample(model: nn.Module, tiny_tokenizer, seed: int = 0, weights: bool = True, rows: int | None = ROWS) -> Rollout:
    """A generation as hardware.generation_weights runs it (``weights``; ``rows=None``: nothing packed), or plain."""
    torch.manual_seed(seed)
    with generation_weights(model, rows=rows) if weights else contextlib.nullcontext():
        return generate(model, tiny_tokenizer, PROMPTS, **SAMPLING)


def tiny(compose, tiny_overrides, tiny_tokenizer, *overrides: str) -> tuple[nn.Module, object]:
    cfg = compose([*tiny_overrides(None), *overrides])
    return models.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0), cfg


def lora_model(compose, tiny_overrides, tiny_tokenizer) -> nn.Module:
    model, cfg = tiny(compose, tiny_overrides, tiny_tokenizer, "model.lora.enabled=true", "model.lora.r=4")
    model = models.apply_lora(model, cfg.model.lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft starts B at zero (ΔW = 0): give the adapters something to merge
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def batch(tiny_tokenizer) -> dict[str, torch.Tensor]:
    return tiny_tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)


def logits_of(model: nn.Module, inputs: dict[str, torch.Tensor], autocast: bool = False) -> torch.Tensor:
    """The model's logits without gradient, under bf16 autocast if asked."""
    with torch.no_grad(), torch.autocast(**AUTOCAST, enabled=autocast):
        return model(**inputs).logits


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_lora_merged_equals_the_adapted_layers_in_fp32_and_writes_nothing(compose, tiny_overrides, tiny_tokenizer):
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    inputs = batch(tiny_tokenizer)
    before = snapshot(model)
    want = logits_of(model, inputs)
    lora_layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    with generation_weights(model) as patched:  # float32: by default peft's computation unmerged, bit for bit
        assert patched == len(lora_layers) > 0
        assert torch.equal(logits_of(model, inputs), want)
    with generation_weights(model, merge_lora=True) as patched:
        got = logits_of(model, inputs)
    assert patched == len(lora_layers)  # only the LoRA layers change (no autocast casts to save)
    assert (got - want).abs().max() < 1e-5
    with model.disable_adapter():
        base = logits_of(model, inputs)
    assert (got - base).abs().max() > 1e-3  # the adapters change the output: the merge is not a no-op
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no weight written
    assert all("forward" not in layer.__dict__ for layer in model.modules())  # every forward restored


def lora_layer(**options) -> nn.Module:
    """A peft LoRA layer over a [6, 8] Linear with two adapters, both active, B non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(8, 6)),
                           LoraConfig(target_modules=["0"], r=2, lora_alpha=4, lora_dropout=0.3, **options), "first")
    model.add_adapter("second", LoraConfig(target_modules=["0"], r=3, lora_alpha=3, **options))
    model.base_model.set_adapter(["first", "second"])
    layer = model.base_model.model[0]
    with torch.no_grad():
        for name in ("first", "second"):
            layer.lora_B[name].weight.normal_()
    return layer.eval()


def test_unmerged_lora_forward_is_peft_s_bit_for_bit_and_only_where_peft_computes_so():
    layer = lora_layer()
    assert layer.active_adapters == ["first", "second"]
    x = torch.randn(4, 3, 8)
    with torch.no_grad():
        want = layer(x)
        assert torch.equal(gw._lora_unmerged(layer)(x), want)
        layer.set_adapter("second")  # the adapters are read when the forward is made
        assert not torch.equal(layer(x), want) and torch.equal(gw._lora_unmerged(layer)(x), layer(x))
    layer.set_adapter(["first", "second"])
    unmerged = gw._lora_unmerged(layer)
    torch.manual_seed(1)
    dropped = layer.train()(x)  # dropout draws in training mode: peft's own forward, the same draws
    torch.manual_seed(1)
    assert torch.equal(unmerged(x), dropped) and not torch.equal(dropped, want)
    layer.eval().enable_adapters(False)
    assert gw._lora_unmerged(layer) is None
    assert gw._lora_unmerged(lora_layer(use_dora=True)) is None  # a variant (DoRA) computes otherwise
    assert gw._lora_unmerged(nn.Linear(8, 6)) is None


def test_opened_inside_itself_it_keeps_the_outer_weights(compose, tiny_overrides, tiny_tokenizer):
    """One merge for several generation calls (one per prompt group under trainer.seed_per_prompt)."""
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    with generation_weights(model, merge_lora=True) as outer:
        products = [layer.__dict__["forward"] for layer in layers]
        with generation_weights(model, merge_lora=True) as inner:
            assert inner == 0
        assert [layer.__dict__.get("forward") for layer in layers] == products  # still the outer's
    assert outer == len(layers) > 0
    assert all("forward" not in layer.__dict__ for layer in layers)
    with generation_weights(model, merge_lora=True) as again:  # closed: a later call merges anew
        assert again == outer


def test_an_adapter_that_is_off_is_not_merged(compose, tiny_overrides, tiny_tokenizer):
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    inputs = batch(tiny_tokenizer)
    with model.disable_adapter():
        want = logits_of(model, inputs)
        with generation_weights(model, merge_lora=True) as patched:
            got = logits_of(model, inputs)
    assert patched == 0
    assert torch.equal(got, want)


def test_frozen_layers_use_exactly_autocast_s_cast(compose, tiny_overrides, tiny_tokenizer):
    """A frozen float32 layer under autocast: the product with the cast made once is autocast's, bit for bit."""
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    model = model.eval().requires_grad_(False)
    inputs = batch(tiny_tokenizer)
    want = logits_of(model, inputs, autocast=True)
    with torch.autocast(**AUTOCAST), generation_weights(model) as patched:
        got = logits_of(model, inputs, autocast=True)
    assert patched == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(got, want)
    with generation_weights(model) as patched:  # float32 without autocast: nothing to cast
        assert patched == 0


def test_lora_generation_in_fp32_is_peft_s_and_under_autocast_agrees_with_a_fresh_pass(
        compose, tiny_overrides, tiny_tokenizer, monkeypatch):
    """float32: the same tokens and bit-equal logits as sampling through peft's layers; bf16 autocast: the
    merged adapters' log-probs are a fresh (unmerged) forward pass's to bfloat16 rounding."""
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    default = sample(model, tiny_tokenizer)
    plain = sample(model, tiny_tokenizer, weights=False)
    assert torch.equal(default.input_ids, plain.input_ids)
    assert torch.equal(default.policy_logits, plain.policy_logits)
    with torch.autocast(**AUTOCAST):
        merged = sample(model, tiny_tokenizer)
        with torch.no_grad():
            fresh, _ = response_logits(model, merged.input_ids, merged.attention_mask, merged.prompt_width, 1.0)
    fresh_logprobs = gather_logprobs(fresh, merged.response_ids) * merged.response_mask
    assert (merged.logprobs - fresh_logprobs).abs().max() < 0.05  # bf16 products: ~3 significant digits


def test_store_frozen_weights_halves_the_reference_and_keeps_its_numbers(compose, tiny_overrides, tiny_tokenizer):
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    reference = model.eval().requires_grad_(False)
    inputs = batch(tiny_tokenizer)
    want = logits_of(reference, inputs, autocast=True)
    assert Precision("fp32", "cpu").store_frozen_weights(reference) == 0
    linear = [m for m in reference.modules() if isinstance(m, nn.Linear)]
    stored = Precision("bf16-mixed", "cpu").store_frozen_weights(reference)
    assert stored == len(linear) - 1  # every matrix but the LM head tied to the embedding
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    assert reference.lm_head.weight.dtype == torch.float32
    assert {m.weight.dtype for m in linear if m is not reference.lm_head} == {torch.bfloat16}
    assert torch.equal(logits_of(reference, inputs, autocast=True), want)  # autocast cast them to bf16 anyway


def test_store_frozen_weights_leaves_lora_s_trainable_adapters_in_float32(compose, tiny_overrides, tiny_tokenizer):
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    inputs = batch(tiny_tokenizer)
    want = logits_of(model, inputs, autocast=True)
    Precision("bf16-mixed", "cpu").store_frozen_weights(model)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {dtype for name, dtype in dtypes.items() if "lora_" in name} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if "base_layer" in name} == {torch.bfloat16}
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.float32
    assert torch.equal(logits_of(model, inputs, autocast=True), want)


def packs_here() -> bool:
    """Whether this CPU has oneDNN's bfloat16 kernels (the packed products' precondition)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def sample_bf16(model: nn.Module, tiny_tokenizer, seed: int = 0, packed: bool = True) -> Rollout:
    """Under bf16 autocast, with the generation weights packed for the decode's rows or (``packed=False``) not."""
    with torch.autocast(**AUTOCAST):
        return sample(model, tiny_tokenizer, seed, rows=ROWS if packed else None)


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_packed_products_sample_what_the_plain_products_sample_bit_for_bit(compose, tiny_overrides, tiny_tokenizer,
                                                                           monkeypatch):
    """Full fine-tuning under bf16 autocast: every Linear (the tied LM head too) multiplies by its packed cast,
    and the tokens, logits and log-probs are those of autocast's own products."""
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    before = snapshot(model)
    with torch.autocast(**AUTOCAST), generation_weights(model, rows=6) as patched:
        assert patched == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    packed = sample_bf16(model, tiny_tokenizer)
    plain = sample_bf16(model, tiny_tokenizer, packed=False)
    assert torch.equal(packed.input_ids, plain.input_ids)
    assert torch.equal(packed.policy_logits, plain.policy_logits)
    assert torch.equal(packed.logprobs, plain.logprobs)
    assert all(torch.equal(before[k], v) for k, v in snapshot(model).items())  # no weight written
    assert all("forward" not in layer.__dict__ for layer in model.modules())  # every forward restored


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_packed_lora_and_frozen_layers_sample_what_the_merged_products_sample(compose, tiny_overrides, tiny_tokenizer,
                                                                              monkeypatch):
    model = lora_model(compose, tiny_overrides, tiny_tokenizer)
    with torch.autocast(**AUTOCAST), generation_weights(model, rows=6) as patched:
        inside_lora = {id(part) for m in model.modules() if hasattr(m, "lora_A") for part in m.modules()}
        assert patched == sum(hasattr(m, "lora_A") or type(m) is nn.Linear and id(m) not in inside_lora
                              for m in model.modules()) > 1  # merged LoRA layers, and the frozen tied LM head
    packed = sample_bf16(model, tiny_tokenizer, seed=3)
    plain = sample_bf16(model, tiny_tokenizer, seed=3, packed=False)
    assert torch.equal(packed.input_ids, plain.input_ids)
    assert torch.equal(packed.policy_logits, plain.policy_logits)


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_a_packed_kernel_that_rounds_otherwise_is_not_used(compose, tiny_overrides, tiny_tokenizer, monkeypatch):
    """The once-per-shape check: a packed product one ulp off F.linear's anywhere leaves every layer on F.linear
    (here no layer changes: the trainable float32 layers keep autocast's cached casts)."""
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    plain = sample_bf16(model, tiny_tokenizer)  # before the patch: the cache of checked shapes fills here
    monkeypatch.setattr(gw, "_PACKED_EXACT", {})
    exact = gw._packed
    monkeypatch.setattr(gw, "_packed", lambda *args: (exact(*args).float() * (1 + 2**-6)).to(torch.bfloat16))
    with torch.autocast(**AUTOCAST), generation_weights(model, rows=6) as patched:
        assert patched == 0
    assert set(gw._PACKED_EXACT.values()) == {False}
    again = sample_bf16(model, tiny_tokenizer)
    assert torch.equal(again.input_ids, plain.input_ids)
    assert torch.equal(again.policy_logits, plain.policy_logits)


def test_nothing_is_packed_in_float32(compose, tiny_overrides, tiny_tokenizer):
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    with generation_weights(model, rows=6) as patched:
        assert patched == 0
    assert gw.packed_product(torch.ones(4, 4), None, 2, torch.float32) is None
    assert gw.packed_product(torch.ones(4, 4, device="meta"), None, 2, torch.bfloat16) is None  # not a CPU


class Shard(torch.Tensor):
    """A tensor subclass standing for FSDP's sharded weights."""


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_tensor_subclasses_are_not_packed():
    weight = torch.ones(4, 4)
    assert gw.packed_product(nn.Parameter(weight), None, 2, torch.bfloat16) is not None
    assert gw.packed_product(nn.Parameter(weight.as_subclass(Shard)), None, 2, torch.bfloat16) is None


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def counted_products(monkeypatch) -> list[int]:
    """From here on, every packed product appends to the list returned."""
    calls = []
    exact = gw._packed
    monkeypatch.setattr(gw, "_packed", lambda *args: calls.append(1) or exact(*args))
    return calls


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
def test_siblings_on_one_input_multiply_once_and_each_gets_its_own_product(monkeypatch):
    """q/k/v-style siblings: one packed product per input tensor, each layer's columns equal to its own
    F.linear; another tensor, or the same tensor changed in place, is multiplied again."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 8, generator=generator) for n in (6, 2, 2)]
    biases = [torch.randn(n, generator=generator).to(torch.bfloat16) for n in (6, 2, 2)]
    forwards = gw.packed_products(weights, biases, 4, torch.bfloat16)
    assert forwards is not None and len(forwards) == 3

    def expected(x, index):
        return torch.nn.functional.linear(x.to(torch.bfloat16), weights[index].to(torch.bfloat16), biases[index])

    calls = counted_products(monkeypatch)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
    assert all(torch.equal(forward(x), expected(x, i)) for i, forward in enumerate(forwards))
    assert len(calls) == 1
    assert torch.equal(forwards[1](y), expected(y, 1)) and len(calls) == 2  # another input
    y.mul_(2)
    assert torch.equal(forwards[2](y), expected(y, 2)) and len(calls) == 3  # changed in place
    assert gw.packed_products([weights[0], weights[1][:, :4]], biases[:2], 4, torch.bfloat16) is None  # two inputs
    assert gw.packed_products(weights[:2], [biases[0], None], 4, torch.bfloat16) is None  # one bias missing


@pytest.mark.skipif(not packs_here(), reason="no oneDNN bfloat16 kernels on this CPU")
@pytest.mark.parametrize(("siblings", "per_block"), [
    (gw.SHARED_INPUT, 4),  # q/k/v as one product, o, gate/up as one, down
    ((("gate_proj", "down_proj"),), 7),  # two input sizes: refused, each layer packed on its own
])
def test_siblings_multiply_as_one_product_where_they_can(compose, tiny_overrides, tiny_tokenizer, monkeypatch,
                                                         siblings, per_block):
    model, _ = tiny(compose, tiny_overrides, tiny_tokenizer)
    inputs = batch(tiny_tokenizer)
    want = logits_of(model, inputs, autocast=True)
    monkeypatch.setattr(gw, "SHARED_INPUT", siblings)
    calls = counted_products(monkeypatch)
    with torch.autocast(**AUTOCAST), generation_weights(model, rows=2) as patched:
        calls.clear()  # the checks of new shapes call it too
        got = logits_of(model, inputs, autocast=True)
    layers = model.config.num_hidden_layers
    assert patched == 7 * layers + 1  # every Linear, the LM head too
    assert len(calls) == per_block * layers + 1
    assert torch.equal(got, want)
