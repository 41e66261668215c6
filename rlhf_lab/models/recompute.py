"""Selective activation recomputation: parts of every decoder layer whose activations the training pass drops.

``trainer.recompute`` names submodules of each decoder layer (``mlp``, ``input_layernorm``, ...). During the
policy's training forward pass each of them runs under ``torch.utils.checkpoint`` (non-reentrant): only its
inputs are kept, and the backward pass runs it again to get the rest. A recomputation repeats the same
operations on the same inputs under the same autocast state (and the same random state for dropout), so the
gradients are the ones the plain pass gives, bit for bit; what changes is memory against time (each
recomputed part's forward runs twice).

``null`` (the default) leaves the choice to the hardware profile: with ``hardware.recompute`` (``cpu_tuned``) it
picks, for full fine-tuning, both norms and the MLP wherever a layer has them (most of a Llama-family layer's
activations for little time); under a LoRA adapter nothing (each recomputed MLP would run peft's adapter products
again). The attention cannot be recomputed alone: its forward appends to the key/value cache the scoring pass
shares between the rows of a prompt, and a second run would append again. ``[]`` turns it off; it is off under
``trainer.gradient_checkpointing`` (transformers recomputes whole layers there).

The wrapping is temporary (an instance ``forward`` set for the training pass, removed after it), so module
names, state dicts, copies of the model and every pass without gradients are untouched.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime.distributed import transformer_blocks, unwrap

AUTO = ("input_layernorm", "post_attention_layernorm", "mlp")
CACHE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past")


def _takes_cache(module: nn.Module) -> bool:
    return any(name in CACHE_ARGUMENTS for name in inspect.signature(module.forward).parameters)


def _candidates(block: nn.Module) -> list[str]:
    """Names of ``block``'s direct submodules that can be recomputed (those that take no key/value cache)."""
    return [name for name, child in block.named_children() if not _takes_cache(child)]


def check_config(trainer_cfg: Any, checkpointing: bool | None = None) -> None:
    """Parts named beside whole-layer checkpointing: ``checkpointing`` where the model says (null
    ``trainer.gradient_checkpointing`` is on under CUDA), else the config's (run before any loads)."""
    if checkpointing is None:
        checkpointing = bool(trainer_cfg.gradient_checkpointing)
    if trainer_cfg.recompute and checkpointing:
        why = " (null: on under CUDA)" if trainer_cfg.gradient_checkpointing is None else ""
        raise ConfigError(f"trainer.recompute={list(trainer_cfg.recompute)}: trainer.gradient_checkpointing{why} "
                          "already recomputes whole layers; set trainer.recompute=[] or "
                          "trainer.gradient_checkpointing=false")


def recompute_modules(model: nn.Module, trainer_cfg: Any, auto: bool = False) -> list[nn.Module]:
    """The submodules ``trainer.recompute`` names, in every decoder layer of ``model`` (``null``: the parts
    :data:`AUTO` under full fine-tuning where ``auto``, else none); one-line errors for a name a layer lacks or a
    part that cannot be recomputed."""
    names = trainer_cfg.recompute
    blocks = transformer_blocks(model)
    checkpointed = bool(trainer_cfg.gradient_checkpointing) or bool(checkpointed_layers(model))
    if names is None:
        if not auto or checkpointed or not blocks or hasattr(unwrap(model), "peft_config"):
            return []
        names = [name for name in AUTO if all(name in _candidates(block) for block in blocks)]
    check_config(trainer_cfg, checkpointed)
    names = list(dict.fromkeys(names))  # a name given twice is one part
    if names and not blocks:
        raise ConfigError(f"trainer.recompute={names}: the model has no decoder layers (a ModuleList named "
                          "'layers') to recompute parts of; set trainer.recompute=[]")
    modules = []
    for block in blocks:
        valid, children = _candidates(block), dict(block.named_children())
        for name in names:
            child = children.get(name)
            if child is None or name not in valid:
                why = "takes the key/value cache" if child is not None else "is not a submodule of every decoder layer"
                raise ConfigError(f"trainer.recompute: {name!r} {why}; valid names: {', '.join(valid)} "
                                  "(or [] for none)")
            modules.append(child)
    return modules


@contextmanager
def recomputing(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, each of ``modules`` keeps only its inputs for the backward pass, which recomputes it;
    a no-op where gradients are off (nothing is kept for a backward pass there)."""
    if not modules or not torch.is_grad_enabled():
        yield
        return
    own = [module.__dict__.get("forward") for module in modules]  # a forward set on the instance (hooks)
    for module in modules:
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
    try:
        yield
    finally:
        for module, forward in zip(modules, own, strict=True):
            if forward is None:
                del module.forward  # the class's forward again
            else:
                module.forward = forward


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers transformers' activation checkpointing wraps (``trainer.gradient_checkpointing``), if enabled."""
    return [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True]


@contextmanager
def layers_checkpointing(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, transformers' activation checkpointing recomputes ``layers`` (:func:`checkpointed_layers`
    of the policy, found once) whatever the model's train/eval mode.

    transformers checkpoints a layer only while that layer is in training mode, and a model from
    ``from_pretrained`` is in eval mode (as the policy stays: no dropout in any pass), so
    ``trainer.gradient_checkpointing`` alone recomputed nothing there and every layer's activations were kept.
    Only the layers' own flags are set (not their submodules': attention and dropout stay in eval mode), and put
    back after the block; a backward pass after it still recomputes (it does not read the flag again). A no-op
    where gradients are off."""
    layers = layers if torch.is_grad_enabled() else []
    was = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, training in zip(layers, was, strict=True):
            layer.training = training
