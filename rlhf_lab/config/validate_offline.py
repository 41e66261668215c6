"""The offline stages (``algorithm=sft|dpo|reward_model``) and their data: which data each reads, loss
choices and ranges, batches that keep a pair's two rows together, single-process runs."""

from __future__ import annotations

from typing import Any

from rlhf_lab.config.validate_values import at_least, choice
from rlhf_lab.errors import ConfigError
from rlhf_lab.offline.data import FORMATS, ON_INVALID
from rlhf_lab.offline.losses import IPO_NORMALIZE, smoothed_losses
from rlhf_lab.offline.reward_model import POOLINGS
from rlhf_lab.registry import get, names
from rlhf_lab.runtime import distributed

EXPORTS = ("merged", "adapter")  # algorithm.export under LoRA


def check_offline_data(data: Any) -> None:
    if "on_invalid" not in data:
        return
    choice("data.format", data.format, FORMATS)
    choice("data.on_invalid", data.on_invalid, ON_INVALID)
    at_least("data.max_response_tokens", data.max_response_tokens, 1)
    if "samples_per_prompt" in data:
        at_least("data.samples_per_prompt", data.samples_per_prompt, 2)
        at_least("data.max_prompts", data.max_prompts, 0)
        at_least("data.max_new_tokens", data.max_new_tokens, 1)
        at_least("data.min_gap", data.min_gap, 0.0)


def check_offline(cfg: Any) -> None:
    """Raise ConfigError for an offline stage with the wrong data or a bad loss option (or online data for an
    online algorithm)."""
    algorithm, data = cfg.algorithm, cfg.data
    stage = get("algorithm", algorithm.name)
    check_offline_data(data)
    offline = getattr(stage, "offline", False)
    if not offline:
        if "on_invalid" in data:
            raise ConfigError(f"data={data.name} holds examples for algorithm=sft|dpo|reward_model; "
                              f"algorithm={algorithm.name} samples from prompts: use data=movie_prompts|jsonl|csv|hub")
        return
    wanted = "chosen_column" if stage.pairs else "response_column"
    if wanted not in data:
        options = "preferences|embedded_preferences" if stage.pairs else "demonstrations"
        raise ConfigError(f"algorithm={algorithm.name} trains on {'preference pairs' if stage.pairs else 'demonstrations'}; "
                          f"data={data.name} has none: use data={options}")
    choice("algorithm.export", algorithm.export, EXPORTS)
    if distributed.launched_processes() > 1:
        raise ConfigError(f"algorithm={algorithm.name} runs in one process; launch it without torchrun")
    if "loss_type" in algorithm:
        choice("algorithm.loss_type", algorithm.loss_type, names("preference_loss"))
        at_least("algorithm.beta", algorithm.beta, 0.0, strict=True)
        if not 0.0 <= algorithm.label_smoothing < 0.5:
            raise ConfigError(f"algorithm.label_smoothing={algorithm.label_smoothing!r} is out of range; must be in [0, 0.5)")
        smoothed = smoothed_losses()
        if algorithm.label_smoothing > 0 and algorithm.loss_type not in smoothed:
            raise ConfigError(f"algorithm.label_smoothing={algorithm.label_smoothing!r} has no meaning for "
                              f"algorithm.loss_type={algorithm.loss_type}; it applies to {', '.join(smoothed)}")
        choice("algorithm.ipo_normalize", algorithm.ipo_normalize, IPO_NORMALIZE)
        at_least("algorithm.nll_weight", algorithm.nll_weight, 0.0)
    if "packing_length" in algorithm:
        at_least("algorithm.packing_length", algorithm.packing_length, 2)  # null: the longest unpacked row
    if "pooling" in algorithm:
        choice("algorithm.pooling", algorithm.pooling, POOLINGS)
        at_least("algorithm.center_rewards_coefficient", algorithm.center_rewards_coefficient, 0.0)
        at_least("algorithm.max_length", algorithm.max_length, 2)
    if algorithm.mini_batch_size or algorithm.epochs != 1:
        raise ConfigError(f"algorithm={algorithm.name} takes one optimizer step per batch: leave "
                          "algorithm.mini_batch_size=0 and algorithm.epochs=1 (use trainer.micro_batch_size)")
    if stage.pairs and cfg.trainer.micro_batch_size % 2:
        raise ConfigError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} splits a pair's two rows; "
                          "it must be even")
