"""The generation seam: one interface every engine implements (kind ``generation``, ``generation=NAME``).

The trainer asks an engine for samples and never how they are made. An engine is built once per run from the
policy, the tokenizer and the sampling settings, and then:

- ``generate(prompts, group_size, seeds=None, greedy=False, settings=None) -> Samples``: ``group_size`` responses
  per prompt (``prompts`` already formatted, e.g. through the chat template, or token ids taken as they are: a
  multi-turn context is never re-tokenised, see :mod:`rlhf_lab.envs`), their token ids, the response mask and the
  sampler's own per-token log-probs (π_old); ``seeds`` gives each prompt group its own generator, so samples do not
  depend on batching or on ranks; ``greedy`` decodes the most likely token (ReMax's baseline); ``settings``
  replaces the engine's sampling settings for this call (an evaluation's own temperature, say);
- ``submit(prompts, group_size, seeds=None, settings=None) -> claim``: the same batch started now, and returned
  by ``claim()`` (``generation.max_staleness=1``): an engine on devices of its own samples it while the trainer
  trains; one in the trainer's process samples it at once (:class:`SamplesInPlace`);
- ``sync_weights(policy)``: the policy's current weights become the ones it samples with;
- ``sleep(level)`` / ``wake_up(tags)``: give back and take again the memory it holds between generations (vLLM's
  sleep mode: level 1 keeps a host copy of the weights, level 2 drops them; tags ``weights``, ``kv_cache``).

The last two are the rollout worker's alone (:mod:`rlhf_lab.generation.worker`): it decides when an engine wakes,
takes weights, samples and sleeps, in one order for every engine. What an engine can do is said by its attributes,
never its name: ``holds_weights`` (a copy of its own to keep current; the worker's weight-sync canary checks it),
``sleeps`` (it gives its memory back between generations), ``lora`` (it takes the policy's adapter, not its
weights), ``reports_entropy`` (its rollouts carry entropies and logits), ``trainer_logprobs`` (its log-probs come from
the training model's own forward pass, so in fp32 they are the trainer's numbers; an engine without it is rescored
under ``generation.logprobs=auto``, see :class:`rlhf_lab.step.scoring_pass.ScoringPlan`).

``hf`` (:mod:`rlhf_lab.generation.hf`) samples with the policy's own transformers forward passes; its weights are
the policy's, so ``sync_weights``, ``sleep`` and ``wake_up`` have nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlhf_lab.errors import DataError
from rlhf_lab.generation.rollout import Samples
from rlhf_lab.registry import get

Prompt = str | list[int]  # formatted text (tokenised without special tokens), or token ids used as they are


def check_prompt_lengths(lengths: Sequence[int], limit: int) -> None:
    """Every engine's one-line refusal of a prompt longer than the room it has for prompts: ``data.max_prompt_tokens``,
    plus ``env.max_tokens`` for a multi-turn episode's later turns (an environment's opening messages, its system turn
    and tools block included, count as prompt)."""
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if longest is not None and lengths[longest] > limit:
        raise DataError(f"prompt {longest} is {lengths[longest]} tokens, over the {limit} the engine has for prompts "
                        "(data.max_prompt_tokens, plus env.max_tokens in a multi-turn episode); raise "
                        "data.max_prompt_tokens or shorten the prompt")


def encode_prompts(tokenizer: Any, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's token ids: text tokenised without added special tokens, id lists kept as they are."""
    return [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]


def left_padded(ids: list[list[int]], pad_token_id: int) -> dict[str, Tensor]:
    """Token id lists as one left-padded batch: ``input_ids`` and ``attention_mask`` [N, longest]."""
    width = max(map(len, ids))
    return {"input_ids": torch.tensor([[pad_token_id] * (width - len(row)) + row for row in ids], dtype=torch.long),
            "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], dtype=torch.long)}


@dataclass(frozen=True)
class SamplingSettings:
    """What every engine samples with (``trainer.*`` and ``data.max_prompt_tokens``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 512
    stop: tuple[str, ...] = ()  # a response also ends once its text ends with one of these (kept in it)
    seed: int = 0  # the run's ``seed``: an engine's own random stream, for the requests without a seed of their own

    @classmethod
    def from_config(cls, cfg: Any) -> SamplingSettings:
        """The run's settings. Under a multi-turn environment a turn's prompt is the episode so far: the longest
        is the prompt and the episode's whole budget (``env.max_tokens``), which an engine sizes its context for."""
        trainer = cfg.trainer
        generation = cfg.get("generation") or {}
        env = cfg.get("env") or {}
        episodes = env.get("name", "single_turn") != "single_turn" and not get("env", env["name"]).single_turn
        prompt_tokens = cfg.data.max_prompt_tokens + (int(env["max_tokens"]) if episodes else 0)
        return cls(trainer.max_new_tokens, trainer.temperature, trainer.top_p, trainer.top_k,
                   prompt_tokens, tuple(generation.get("stop", None) or ()), int(cfg.get("seed", 0)))


class GenerationBackend(Protocol):
    """What the trainer needs of a generation engine (see the module's text)."""

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Samples: ...

    def submit(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
               settings: SamplingSettings | None = None) -> Callable[[], Samples]: ...

    def sync_weights(self, policy: nn.Module) -> None: ...

    def sleep(self, level: int = 2) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


class SamplesInPlace:
    """``submit`` for an engine that samples in the trainer's own process (it would compete with the training
    passes for the same device): the batch is sampled at once, and the claim returns it."""

    def submit(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
               settings: SamplingSettings | None = None) -> Callable[[], Samples]:
        rollout = self.generate(prompts, group_size, seeds=seeds, settings=settings)  # type: ignore[attr-defined]
        return lambda: rollout
