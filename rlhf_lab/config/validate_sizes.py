"""Sizes a run cannot fit or finish, and settings it cannot learn with: checked before any model loads.

A batch of a million samples, a LoRA rank of 10**8 or a refill loop of 10**9 rounds would allocate until the
allocator fails or run for ever; 100,000 threads crash torch; shapes a Llama cannot take (a hidden size the heads
do not divide) fail deep in transformers. Each is one line naming the key, the value and the limit. Settings that
run but cannot learn (LoRA's ``alpha=0`` scales the adapter's update to nothing; a KL coefficient of 10**300 leaves
only the KL) are a warning, not an error: the run may be a deliberate control.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from rlhf_lab.config.schema import LARGE_KL_COEF
from rlhf_lab.errors import ConfigError

MAX_SAMPLES_PER_STEP = 1 << 16  # prompts_per_step x group_size: 65,536 samples a step
MAX_REFILL_ROUNDS = 100  # dynamic sampling's extra generation rounds a step
MAX_LORA_RANK = 4096  # beyond any layer width LoRA is used on here; the rank of a layer is at most its width
MIN_TEMPERATURE = 1e-3  # logits divided by less overflow float32 (use a greedy evaluation for the most likely token)


def check_sizes(cfg: Any) -> None:
    trainer, algorithm, model = cfg.trainer, cfg.algorithm, cfg.model
    samples = trainer.prompts_per_step * algorithm.get("group_size", 1)
    if samples > MAX_SAMPLES_PER_STEP:
        raise ConfigError(f"trainer.prompts_per_step={trainer.prompts_per_step} x algorithm.group_size="
                          f"{algorithm.get('group_size', 1)} = {samples} samples a step cannot fit; at most "
                          f"{MAX_SAMPLES_PER_STEP} (raise trainer.steps instead)")
    if algorithm.get("max_refill_rounds", 0) > MAX_REFILL_ROUNDS:
        raise ConfigError(f"algorithm.max_refill_rounds={algorithm.max_refill_rounds} cannot finish; at most "
                          f"{MAX_REFILL_ROUNDS} extra generation rounds a step")
    cores = os.cpu_count() or 1
    if trainer.num_threads < 0:  # torch would take it as its default without a word
        raise ConfigError(f"trainer.num_threads={trainer.num_threads} is not a thread count; 0 (torch's default) or "
                          f"1-{4 * cores}")
    if cfg.get("logger") and cfg.logger.get("samples_every", 0) < 0:  # it would mean "never" without a word
        raise ConfigError(f"logger.samples_every={cfg.logger.samples_every} is not a step interval; 0 (no sample "
                          "tables sent to the tracker) or a positive number of steps")
    if trainer.num_threads and trainer.num_threads > 4 * cores:
        raise ConfigError(f"trainer.num_threads={trainer.num_threads} is more than 4 threads per core of this "
                          f"machine's {cores}; at most {4 * cores} (0: torch's default)")
    if trainer.temperature < MIN_TEMPERATURE:
        raise ConfigError(f"trainer.temperature={trainer.temperature:g} overflows the logits it divides; at least "
                          f"{MIN_TEMPERATURE:g} (eval.greedy=true evaluates the most likely tokens)")
    lora = model.lora
    if lora.enabled and lora.r > MAX_LORA_RANK:
        raise ConfigError(f"model.lora.r={lora.r} cannot fit; at most {MAX_LORA_RANK} (a layer's rank is at most "
                          "its width)")
    for dims_key in ("tiny", "exact"):
        if model.name == dims_key and dims_key in model:
            check_llama_shape(f"model.{dims_key}", model[dims_key])
    if lora.enabled and lora.alpha == 0:
        warnings.warn("model.lora.alpha=0 scales the adapter's update by 0: the policy never changes", stacklevel=2)
    if cfg.kl.coef > LARGE_KL_COEF:
        warnings.warn(f"kl.coef={cfg.kl.coef:g}: the KL term outweighs any task reward, the policy can only stay at "
                      "the reference", stacklevel=2)


def check_llama_shape(where: str, dims: Any) -> None:
    """The shapes a Llama takes: layers and heads at least 1, heads dividing the hidden size, key/value heads
    dividing the heads."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size"):
        if dims[key] < 1:
            raise ConfigError(f"{where}.{key}={dims[key]} must be at least 1")
    if dims.hidden_size % dims.num_attention_heads:
        raise ConfigError(f"{where}.hidden_size={dims.hidden_size} does not split into "
                          f"{where}.num_attention_heads={dims.num_attention_heads} heads")
    if dims.num_attention_heads % dims.num_key_value_heads:
        raise ConfigError(f"{where}.num_attention_heads={dims.num_attention_heads} does not split into groups of "
                          f"{where}.num_key_value_heads={dims.num_key_value_heads}")
