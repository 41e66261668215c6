"""The run's models for a plan: read from a config alone, built on the meta device, then given (fake) storage.

A model is its ``config.json``: no weights are read. The policy and reference are built as
:func:`rlhf_lab.models.loading.build_policy` builds them, on the meta device (no memory), then materialised on fake
tensors (or, to calibrate the plan, on real ones with any finite values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhf_lab.errors import ConfigError
from rlhf_lab.models.loading import (
    DTYPES,
    PolicyAndReference,
    apply_lora,
    enable_activation_checkpointing,
    frozen_copy,
    model_config,
)
from rlhf_lab.runtime.precision import Precision

CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # architectures that predict the next token


def transformers_config(model_cfg: Any, tokenizer: Any) -> Any:
    """The model's transformers config, no weights read; a one-line error where ``model=`` names no causal LM."""
    from transformers import AutoModelForCausalLM

    if model_cfg.name == "exact":
        from rlhf_lab.testbed.task import build_model

        with torch.device("meta"):
            return build_model(tokenizer, model_cfg.exact).config
    try:
        config = model_config(model_cfg, tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.name_or_path={model_cfg.name_or_path!r}: no readable config.json "
                          f"({str(error).splitlines()[0]})") from None
    kinds = getattr(config, "architectures", None) or []
    causal = not kinds or any(kind.endswith(CAUSAL_HEADS) for kind in kinds)
    if type(config) not in AutoModelForCausalLM._model_mapping or not causal:
        kinds = kinds or [type(config).__name__]
        raise ConfigError(f"model.name_or_path={model_cfg.name_or_path!r} is not a causal language model "
                          f"({', '.join(kinds)}); give a model AutoModelForCausalLM loads (Llama, Qwen2, ...)")
    check_shapes(config, model_cfg.name_or_path)
    return config


SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "head_dim")


class ShapesTokenizer:
    """What the planned step reads of a tokenizer, from ``config.json`` alone: a folder with no tokenizer is planned
    from its shapes (the vocabulary's size; the special ids the config names, the pad id its EOS where it names
    none). The prompts are synthetic token ids, so no text is ever encoded."""

    padding_side = "left"

    def __init__(self, config: Any) -> None:
        def first(value: Any) -> int | None:
            return value[0] if isinstance(value, list | tuple) and value else value if isinstance(value, int) else None

        self.vocab_size = int(config.vocab_size)
        self.bos_token_id, self.eos_token_id = first(config.bos_token_id), first(config.eos_token_id)
        pad = first(getattr(config, "pad_token_id", None))
        self.pad_token_id = pad if pad is not None else self.eos_token_id if self.eos_token_id is not None else 0
        self.all_special_ids = sorted({i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id)
                                       if i is not None})

    def __len__(self) -> int:
        return self.vocab_size


def check_config_file(folder: Any) -> None:
    """:func:`check_shapes` of ``folder/config.json`` as written, before transformers reads it (a Llama config with 0
    heads divides by zero as it is built); a file that cannot be read is left to the loaders' own lines."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    try:
        raw = json.loads((Path(str(folder)).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(raw, dict):
        check_shapes(SimpleNamespace(**{key: raw[key] for key in SIZES if key in raw}), folder)


def check_shapes(config: Any, source: Any) -> None:
    """One line where ``config`` (read from ``source``) has a size no model can have: one that is not a positive
    integer (a negative width, 0 heads: transformers divides by them)."""
    for name in SIZES:
        value = getattr(config, name, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ConfigError(f"model.name_or_path={source!r}: its config.json has {name}={value!r}; a model's sizes "
                              "are positive integers")


def build_on_meta(cfg: Any, tokenizer: Any, precision: Precision, fsdp: bool = False) -> PolicyAndReference:
    """The policy and reference as ``build_policy`` makes them, on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(cfg.model, tokenizer)
    dtype = DTYPES[precision.weights_dtype]
    with torch.device("meta"):
        if cfg.model.name == "exact":
            from rlhf_lab.testbed.task import build_model

            model = build_model(tokenizer, cfg.model.exact).to(dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if cfg.model.name != "tiny":  # as the trainer's from_pretrained leaves it (the tiny one is built)
                model.eval()
        if cfg.model.lora.enabled:
            models = PolicyAndReference(apply_lora(model, cfg.model.lora), None, True)
        else:
            # as build_policy copies it: in the compute dtype (under FSDP every weight)
            models = PolicyAndReference(model, frozen_copy(model, precision.compute_dtype, fsdp), False)
    if cfg.trainer.gradient_checkpointing:
        enable_activation_checkpointing(models.policy)
    if not fsdp:  # as Trainer.place_reference does (under FSDP the gathered weights are cast instead)
        precision.store_frozen_weights(models.reference_model())
    return models


def materialize(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` keeping tied parameters tied (``to_empty`` gives each its own tensor)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                owners.setdefault(id(parameter), []).append((owner, name))
    module.to_empty(device=device)
    for places in owners.values():
        first_owner, first_name = places[0]
        for owner, name in places[1:]:
            owner._parameters[name] = first_owner._parameters[first_name]


def storage_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the distinct storages of the modules' parameters and buffers (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for module in modules:
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor = getattr(tensor, "_local_tensor", tensor)  # FSDP's DTensor: this rank's shard
            storage = tensor.untyped_storage()
            seen[storage._cdata] = storage.nbytes()  # the storage itself (its Python wrapper is new at each call)
    return sum(seen.values())


def kv_cache_bytes(config: Any, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for ``rows`` × ``tokens`` positions."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * rows * tokens * heads * head_dim * dtype.itemsize


def initialise(models: PolicyAndReference) -> None:
    """Real tensors for a real run of the step: any finite weights do (memory does not depend on their values)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (models.policy, models.reference):
            for tensor in [] if module is None else [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
        for module in (models.policy, models.reference):
            for sub in [] if module is None else module.modules():
                if hasattr(sub, "rope_init_fn") and hasattr(sub, "inv_freq"):  # rotary frequencies: as built
                    inv_freq, scaling = sub.rope_init_fn(sub.config, sub.inv_freq.device)
                    sub.inv_freq.copy_(inv_freq)
                    sub.original_inv_freq = sub.inv_freq
                    sub.attention_scaling = scaling
                elif hasattr(sub, "weight") and type(sub).__name__.endswith("RMSNorm"):
                    sub.weight.fill_(1.0)
