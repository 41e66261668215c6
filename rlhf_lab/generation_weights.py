"""The weights the decode loop multiplies by, prepared once per generation call.

Two things make a decode step through a LoRA policy cost more than through the full model, both paid again
at every one of the T steps:

- peft's LoRA layer runs the base product, the two adapter products, the casts between the adapter's
  float32 weights and the compute dtype, and an add; at 16 rows these small calls cost more than the base
  product itself;
- autocast keeps its half-precision copy of a weight only for trainable leaves: a frozen float32 weight (the
  LM head tied to LoRA's frozen embedding, any frozen layer) is cast again at every call.

While :func:`generation_weights` is active, each plain LoRA ``Linear`` multiplies by its merged weight
``W + ΔW`` (ΔW = peft's ``get_delta_weight``: B·A times the scaling) and each other frozen ``Linear`` whose
weight autocast would cast multiplies by that cast, both made once when the context opens, as new tensors
in the dtype the product runs in. No weight of the model is written: the base weights are also the
reference under LoRA, and peft's in-place merge and unmerge would move them by float rounding every step.

Both are made where autocast runs the products (a mixed precision): in float32 nothing is cast and the
adapters run as peft runs them, so sampling stays bit-identical to it. The merged products are the
adapted layers' outputs up to float rounding (tests/unit/test_generation_weights.py: logits to 1e-5 when
merged in float32; a frozen layer's cast is exactly autocast's). Layers peft computes differently (DoRA and
other variants, ``fan_in_fan_out``, an adapter already merged or disabled) keep their own forward.

Given the decode's row count (``rows``), each of those bfloat16 weights, and the cast of every other plain
``Linear`` where autocast runs the products in bfloat16, is also laid out once per generation call for
oneDNN's kernel (``mkldnn._reorder_linear_weight``): a plain bfloat16 product re-lays the weight out at every
call. Packing is used only where the packed kernel gives ``F.linear``'s result bit for bit, checked once per
(shape, rows, threads) in the process on random inputs (:func:`packed_product`); elsewhere the layer keeps
its product. Float32 products (MKL's packed sgemm) are not packed: re-packing float32 weights after every
optimizer step costs about what it saves (experiments/BENCHMARK.md, round 7).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn import functional as F

_ACTIVE: set[int] = set()  # ids of the models inside generation_weights now


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a product with ``weight`` runs in here: autocast's where it is on, else the weight's own."""
    device_type = weight.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def _lora_merged(layer: nn.Module) -> Tensor | None:
    """W + ΔW of the active adapters (float32) for a plain peft LoRA ``Linear``; None for any other layer."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not isinstance(layer, LoraLinear) or layer.disable_adapters or layer.merged or layer.fan_in_fan_out:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if not active or any(name in layer.lora_variant for name in active):
        return None
    with torch.autocast(layer.get_base_layer().weight.device.type, enabled=False):  # ΔW at the adapter's precision
        delta = sum(layer.get_delta_weight(name).float() for name in active)
    return layer.get_base_layer().weight.float() + delta


def _frozen_cast(layer: nn.Module) -> Tensor | None:
    """A frozen plain ``Linear``'s weight where autocast would cast it at every call; None otherwise."""
    if type(layer) is not nn.Linear or layer.weight.requires_grad:
        return None
    return layer.weight if compute_dtype(layer.weight) != layer.weight.dtype else None


def _product(weight: Tensor, bias: Tensor | None) -> Callable[..., Tensor]:
    def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        return F.linear(x, weight, bias)

    return forward


_PACKED_EXACT: dict[tuple, bool] = {}  # (shape, bias, rows, threads) -> the packed kernel gives F.linear's numbers


def packed_product(weight: Tensor, bias: Tensor | None, rows: int, dtype: torch.dtype) -> Callable[..., Tensor] | None:
    """A layer forward multiplying by ``weight`` cast to ``dtype`` (bfloat16) in oneDNN's layout packed for
    ``rows``-row products, or None, before any cast, where the products run in another dtype or device, or
    where the kernel is missing or would not give ``F.linear``'s numbers bit for bit (checked once per key on
    random inputs of ``rows`` and of ``5 * rows + 3`` rows, a prefill's count; the global random generator is
    not touched). Inputs are cast to bfloat16 as autocast casts them."""
    if weight.device.type != "cpu" or weight.dim() != 2 or dtype != torch.bfloat16:
        return None
    key = (tuple(weight.shape), bias is not None, rows, torch.get_num_threads())
    if _PACKED_EXACT.get(key) is False:
        return None
    weight = weight.to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        if key not in _PACKED_EXACT:
            generator = torch.Generator().manual_seed(0)
            probes = [torch.randn(n, weight.shape[1], generator=generator).to(weight.dtype) for n in (rows, 5 * rows + 3)]
            with torch.autocast("cpu", enabled=False):
                _PACKED_EXACT[key] = all(torch.equal(_packed(x, packed, bias), F.linear(x, weight, bias)) for x in probes)
    except (RuntimeError, AttributeError, NotImplementedError):  # a build or CPU without oneDNN's bf16 kernels
        _PACKED_EXACT[key] = False
    if not _PACKED_EXACT[key]:
        return None

    def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        return _packed(x, packed, bias)

    return forward


def _packed(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, bias, "none", [None], "")


@contextmanager
def generation_weights(model: nn.Module, merge_lora: bool | None = None, rows: int | None = None) -> Iterator[int]:
    """Inside, LoRA layers multiply by merged weights and frozen layers by their autocast cast, and with
    ``rows`` (the decode's batch rows) every such weight and every other plain ``Linear`` by its packed
    layout (see the module's text); yields how many layers changed. Open it after the last optimizer step:
    the weights are taken when it opens and dropped when it closes, which restores every layer's forward.

    ``merge_lora`` None: merge where autocast is on (a mixed precision, whose products round to bfloat16
    anyway); in float32 the adapters then run as peft runs them and sampling stays bit-identical to it.
    Opened again inside itself for the same model (a generation call per prompt group), it keeps the
    weights the outer one made and yields 0.
    """
    if id(model) in _ACTIVE:
        yield 0
        return
    patched, replaced = [], set()  # replaced: ids of the modules a new forward runs instead of
    parameter = next(model.parameters(), None)
    if merge_lora is None:
        merge_lora = parameter is not None and torch.is_autocast_enabled(parameter.device.type)
    _ACTIVE.add(id(model))
    try:
        with torch.no_grad():
            for layer in model.modules():  # parents come before children: a merged layer's parts are skipped
                if id(layer) in replaced:
                    continue
                weight = _lora_merged(layer) if merge_lora else None
                if weight is None:
                    weight = _frozen_cast(layer)
                plain = weight is None and rows is not None and type(layer) is nn.Linear
                if plain:
                    weight = layer.weight  # packed below, if the kernel gives F.linear's numbers
                if weight is None:
                    continue
                base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
                dtype = compute_dtype(base.weight)
                bias = None if base.bias is None else base.bias.to(dtype)
                forward = packed_product(weight, bias, rows, dtype) if rows else None
                if forward is None:
                    if plain:
                        continue  # not packed: its own forward (autocast's cached cast, if any) is the same product
                    forward = _product(weight.to(dtype), bias)
                replaced.update(id(module) for module in layer.modules())
                layer.forward = forward  # an instance attribute shadows the class's
                patched.append(layer)
        yield len(patched)
    finally:
        _ACTIVE.discard(id(model))
        for layer in patched:
            del layer.forward
