"""Checks of the continuous asynchronous simulator (``generation.continuous=true``,
:mod:`rlhf_lab.generation.continuous`): what it needs, and the settings that cannot run under it, one line each."""

from __future__ import annotations

from typing import Any

from rlhf_lab.errors import ConfigError


def check_continuous(cfg: Any) -> None:
    """``generation.continuous``, ``engine_groups`` and the clock; each conflicting setting named with its way out."""
    generation, trainer = cfg.generation, cfg.trainer
    on = generation.get("continuous", False)
    if not isinstance(on, bool):
        raise ConfigError(f"generation.continuous={on!r} must be true or false")
    groups = generation.get("engine_groups")
    if not on:
        if groups is not None:
            raise ConfigError(f"generation.engine_groups={groups!r} sizes the continuous simulator's engine, which is "
                              "off: set generation.continuous=true, or generation.engine_groups=null")
        return
    batch = trainer.prompts_per_step
    if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool) or groups < batch):
        raise ConfigError(f"generation.engine_groups={groups!r} is out of range; an integer ≥ trainer.prompts_per_step "
                          f"({batch}: the groups a step takes), or null for twice that")
    mode = generation.get("weight_updates", "batch")
    if mode not in ("in_flight", "partial"):
        raise ConfigError(f"generation.continuous=true with generation.weight_updates={mode}: the engine never stops, "
                          "so each update lands between its decode steps; set generation.weight_updates=in_flight "
                          "(the older weights' cache kept) or partial (recomputed)")
    every = generation.get("update_every_tokens", 0)
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ConfigError(f"generation.update_every_tokens={every!r} is out of range; under generation.continuous=true "
                          "an integer ≥ 0: the decode ticks one update of the trainer takes")
    conflicts = {
        "generation.simulate_staleness=true": (generation.get("simulate_staleness", False),
                                               "its lag comes from the clock, not a fixed k"),
        f"generation.max_staleness={generation.get('max_staleness', 0)}": (generation.get("max_staleness", 0),
                                                                           "its lag comes from the clock"),
        f"generation={generation.name}": (generation.name not in ("hf", "vllm_server"), "the engine that never stops "
                                          "is the hf decode's: simulated in the trainer (generation=hf), or for real "
                                          "on rlhf-lab serve --engine hf (generation=vllm_server)"),
        "trainer.strategy=fsdp": (trainer.strategy == "fsdp", "each group decodes alone on one rank"),
        "algorithm.dynamic_sampling=true": (cfg.algorithm.get("dynamic_sampling", False),
                                            "a step takes the groups that completed, it cannot refill"),
        "hardware.generation_weights=true": ((cfg.get("hardware") or {}).get("generation_weights", False),
                                             "a landing update would not reach the decode's copy of the weights"),
        f"env={(cfg.get('env') or {}).get('name', 'single_turn')}": (
            (cfg.get("env") or {}).get("name", "single_turn") != "single_turn", "its groups are single responses"),
    }
    for setting, (conflict, why) in conflicts.items():
        if conflict:
            raise ConfigError(f"generation.continuous=true with {setting}: {why}; drop one of the two")
