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
adapters run unmerged, as peft runs them, so sampling stays bit-identical to it; each plain LoRA ``Linear``
then runs peft's operations in peft's order (the base product, then ``B(A(x)) * scaling`` added per active
adapter) without peft's per-call bookkeeping, which at a decode's few rows costs more than the products.
The merged products are the adapted layers' outputs up to float rounding (tests/unit/test_generation_weights.py: logits to 1e-5 when
merged in float32; a frozen layer's cast is exactly autocast's). Layers peft computes differently (DoRA and
other variants, ``fan_in_fan_out``, an adapter already merged or disabled) keep their own forward.

Given the decode's row count (``rows``), each of those bfloat16 weights, and the cast of every other plain
``Linear`` where autocast runs the products in bfloat16, is also laid out once per generation call for
oneDNN's kernel (``mkldnn._reorder_linear_weight``): a plain bfloat16 product re-lays the weight out at every
call. Packing is used only where the packed kernel gives ``F.linear``'s result bit for bit, checked once per
(shape, rows, threads) in the process on random inputs (:func:`packed_product`); elsewhere the layer keeps
its product. Sibling layers a decoder block calls on one input (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``: ``SHARED_INPUT``) multiply as one packed product of their stacked weights, each
returning its columns, where that too gives each layer's numbers bit for bit: fewer, wider products (the
[192, 576] key and value products are the least efficient of the decode). Float32 products (MKL's packed
sgemm) are not packed: re-packing float32 weights after every optimizer step costs about what it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from rlhf_lab.runtime.distributed import sharded

_ACTIVE: set[int] = set()  # ids of the models inside generation_weights now


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a product with ``weight`` runs in here: autocast's where it is on, else the weight's own."""
    device_type = weight.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def _plain_adapters(layer: nn.Module) -> list[str] | None:
    """The active adapters of a peft LoRA ``Linear`` that runs them as plain LoRA (not disabled, not merged, no
    variant such as DoRA); None for any other layer."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not isinstance(layer, LoraLinear) or layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    return None if any(name in layer.lora_variant for name in active) else active


def _lora_merged(layer: nn.Module) -> Tensor | None:
    """W + ΔW of the active adapters (float32) for a plain peft LoRA ``Linear``; None for any other layer."""
    active = _plain_adapters(layer)
    if not active or layer.fan_in_fan_out:
        return None
    base = layer.get_base_layer().weight
    with torch.autocast(base.device.type, enabled=False):  # ΔW at the adapter's precision
        deltas = [layer.get_delta_weight(name).float() for name in active]  # each a new tensor (B·A·s)
    merged = deltas[0]
    for delta in deltas[1:]:
        merged.add_(delta)
    return merged.add_(base)  # W + ΔW in float32, written into ΔW's memory (no float32 copy of W, no new sum)


def _lora_unmerged(layer: nn.Module) -> Callable[..., Tensor] | None:
    """peft's forward of a plain LoRA ``Linear`` without its per-call bookkeeping (argument checks, adapter
    look-ups, module calls): the base layer's product, then each active adapter's ``B(A(x)) * scaling`` added,
    the same operations in the same order; peft's own forward while a dropout would draw (training mode);
    None where peft computes otherwise (see the module's text)."""
    active = _plain_adapters(layer)
    if active is None:
        return None
    adapters, dropouts = [], []
    for name in active:
        down, up, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if type(down) is not nn.Linear or type(up) is not nn.Linear or type(dropout) not in (nn.Identity, nn.Dropout) \
                or down._forward_hooks or up._forward_hooks:
            return None
        adapters.append((down.weight, down.bias, up.weight, up.bias, layer.scaling[name]))
        dropouts += [dropout] if type(dropout) is nn.Dropout else []
    base, cast = layer.get_base_layer(), getattr(layer, "cast_input_dtype_enabled", True)

    def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        if any(dropout.training for dropout in dropouts):
            return type(layer).forward(layer, x, *args, **kwargs)
        result = base(x, *args, **kwargs)
        dtype = result.dtype
        for down_weight, down_bias, up_weight, up_bias, scaling in adapters:
            if cast and x.dtype != down_weight.dtype:  # peft's _cast_input_dtype
                x = x.to(down_weight.dtype)
            result = result + F.linear(F.linear(x, down_weight, down_bias), up_weight, up_bias) * scaling
        return result.to(dtype)

    return forward


def _frozen_cast(layer: nn.Module) -> Tensor | None:
    """A frozen plain ``Linear``'s weight where autocast would cast it at every call; None otherwise."""
    if type(layer) is not nn.Linear or layer.weight.requires_grad:
        return None
    return layer.weight if compute_dtype(layer.weight) != layer.weight.dtype else None


def _product(weight: Tensor, bias: Tensor | None) -> Callable[..., Tensor]:
    def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        return F.linear(x, weight, bias)

    return forward


_PACKED_EXACT: dict[tuple, bool] = {}  # (shapes, bias, rows, threads) -> the packed kernel gives F.linear's numbers

# Sibling layers a decoder block calls on one input tensor (Llama-family names); with every member packable,
# they multiply as one packed product of their weights stacked, each reading its columns (_SharedInput).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def packed_product(weight: Tensor, bias: Tensor | None, rows: int, dtype: torch.dtype) -> Callable[..., Tensor] | None:
    """A layer forward multiplying by ``weight`` cast to ``dtype`` (bfloat16) in oneDNN's layout packed for
    ``rows``-row products, or None (see :func:`packed_products`)."""
    forwards = packed_products([weight], [bias], rows, dtype)
    return None if forwards is None else forwards[0]


def packed_products(weights: list[Tensor], biases: list[Tensor | None], rows: int,
                    dtype: torch.dtype) -> list[Callable[..., Tensor]] | None:
    """Forwards for layers multiplying by ``weights`` (one input size, all with a bias or none), cast to
    ``dtype`` (bfloat16) and stacked into one weight laid out in oneDNN's layout packed for ``rows``-row
    products; or None, before any cast, where the products run in another dtype or device, or on a tensor
    subclass (FSDP's sharded weights: stacking them would gather them), or where the kernel is missing or
    would not give each layer's ``F.linear`` numbers bit for bit (checked once per key on random inputs of
    ``rows`` and of ``5 * rows + 3`` rows, a prefill's count; the global random generator is not touched). Inputs are cast to bfloat16 as autocast casts them. With several weights, the layers
    must be called on one input tensor in turn (:class:`_SharedInput`)."""
    if dtype != torch.bfloat16 or any(w.device.type != "cpu" or w.dim() != 2 or sharded(w)
                                      for w in weights):  # a tensor subclass: FSDP's DTensor shards, say
        return None
    if len({w.shape[1] for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return None
    key = (tuple(tuple(w.shape) for w in weights), biases[0] is not None, rows, torch.get_num_threads())
    if _PACKED_EXACT.get(key) is False:
        return None
    widths = [w.shape[0] for w in weights]
    if len(weights) == 1:
        weight, bias = weights[0].to(dtype), biases[0]
    else:  # each weight cast straight into its rows of the stack: no cast copies concatenated again
        weight = weights[0].new_empty(sum(widths), weights[0].shape[1], dtype=dtype)
        for part, w in zip(weight.split(widths), weights):
            part.copy_(w)
        bias = None if biases[0] is None else torch.cat(biases)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        if key not in _PACKED_EXACT:
            generator = torch.Generator().manual_seed(0)
            probes = [torch.randn(n, weight.shape[1], generator=generator).to(dtype) for n in (rows, 5 * rows + 3)]
            with torch.autocast("cpu", enabled=False):
                _PACKED_EXACT[key] = all(
                    torch.equal(_packed(x, packed, bias),
                                torch.cat([F.linear(x, w, b) for w, b in zip(weight.split(widths), biases)], -1))
                    for x in probes)
    except (RuntimeError, AttributeError, NotImplementedError):  # a build or CPU without oneDNN's bf16 kernels
        _PACKED_EXACT[key] = False
    if not _PACKED_EXACT[key]:
        return None
    if len(weights) == 1:
        def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
            return _packed(x, packed, bias)

        return [forward]
    shared = _SharedInput(packed, bias)
    return [shared.columns(end - width, end) for width, end in zip(widths, accumulate(widths))]


class _SharedInput:
    """One packed product for sibling layers called on one input tensor in turn: the first call computes it and
    each layer returns its columns. A call on another tensor, or on the same one changed in place since (its
    version counter; inference tensors have none), computes it again: the outputs are always the products."""

    def __init__(self, packed: Tensor, bias: Tensor | None) -> None:
        self.packed, self.bias = packed, bias
        self.input: Tensor | None = None
        self.version: int | None = None
        self.output: Tensor | None = None

    def columns(self, start: int, stop: int) -> Callable[..., Tensor]:
        def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
            version = None if x.is_inference() else x._version
            if x is not self.input or version != self.version:
                self.output = _packed(x, self.packed, self.bias)
                self.input, self.version = x, version
            return self.output[..., start:stop]

        return forward


def _packed(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, bias, "none", [None], "")


class _Plan(NamedTuple):
    """A layer :func:`generation_weights` gives a new forward: the weight (and bias) it multiplies by, in the
    compute dtype; ``plain``: a plain ``Linear`` that keeps its own forward unless packed."""

    layer: nn.Module
    weight: Tensor
    bias: Tensor | None
    dtype: torch.dtype
    plain: bool


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
            plans: dict[str, _Plan] = {}
            for name, layer in model.named_modules():  # parents first: a merged layer's parts are skipped
                if id(layer) in replaced:
                    continue
                unmerged = None if merge_lora else _lora_unmerged(layer)
                if unmerged is not None:  # its base layer (a child) is still cast or packed below where it pays
                    layer.forward = unmerged
                    patched.append(layer)
                    continue
                weight = _lora_merged(layer) if merge_lora else None
                if weight is not None:  # cast now, the cast the product makes: the float32 merge dies here
                    weight = weight.to(compute_dtype(layer.get_base_layer().weight))
                if weight is None:
                    weight = _frozen_cast(layer)
                plain = weight is None and rows is not None and type(layer) is nn.Linear
                if plain:
                    weight = layer.weight  # packed below, if the kernel gives F.linear's numbers
                if weight is None:
                    continue
                base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
                dtype = compute_dtype(base.weight)
                plans[name] = _Plan(layer, weight, None if base.bias is None else base.bias.to(dtype), dtype, plain)
                if not plain:  # a plain Linear has no parts; the others always get a new forward
                    replaced.update(id(module) for module in layer.modules())
            forwards = {}
            for group in _sibling_groups(plans) if rows else []:
                members = [plans[name] for name in group]
                dtypes = {member.dtype for member in members}
                if len(dtypes) == 1:  # refused: each member is packed (or not) on its own below
                    made = packed_products([m.weight for m in members], [m.bias for m in members], rows, dtypes.pop())
                    forwards.update(zip(group, made or []))
            for name, (layer, weight, bias, dtype, plain) in plans.items():
                forward = forwards.get(name) or (packed_product(weight, bias, rows, dtype) if rows else None)
                if forward is None:
                    if plain:
                        continue  # not packed: its own forward (autocast's cached cast, if any) is the same product
                    forward = _product(weight.to(dtype), bias)
                layer.forward = forward  # an instance attribute shadows the class's
                patched.append(layer)
        yield len(patched)
    finally:
        _ACTIVE.discard(id(model))
        for layer in patched:
            del layer.forward


def _sibling_groups(plans: dict[str, _Plan]) -> list[list[str]]:
    """The names of each set of sibling layers in ``plans`` that one block calls on one input (SHARED_INPUT)."""
    groups = []
    for name in plans:
        parent, _, child = name.rpartition(".")
        for names in SHARED_INPUT:
            group = [f"{parent}.{member}" if parent else member for member in names]
            if child == names[0] and all(member in plans for member in group):
                groups.append(group)
    return groups
