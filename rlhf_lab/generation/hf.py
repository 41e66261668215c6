"""The default generation engine (``generation=hf``): the policy's own transformers forward passes, driven by
rlhf_lab's decode loop (:mod:`rlhf_lab.generation.decode`).

Each prompt is prefilled once for its ``group_size`` samples: all but its last token run through the network for
the distinct prompts, the key/value cache is repeated to the rows of each, and decoding continues from it (the
logits equal the unshared run's to float precision). The sampler's log-probs and entropies come from the logits
it samples with, so no second forward pass of the policy is needed for π_old.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import StopStringCriteria

from rlhf_lab.generation.backend import (
    Prompt,
    SamplesInPlace,
    SamplingSettings,
    check_prompt_lengths,
    encode_prompts,
    left_padded,
)
from rlhf_lab.generation.decode import Sampled, decode, gathered_once, multinomial
from rlhf_lab.generation.kv_cache import decode_cache
from rlhf_lab.generation.rollout import Samples
from rlhf_lab.generation.seeded import SeededDraws
from rlhf_lab.registry import register
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.scoring.forward import agreed, position_ids_from_mask, prefill_shared

if TYPE_CHECKING:
    from rlhf_lab.hardware import HardwareProfile


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[Prompt],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_prompt_tokens: int,
    keep_logits: bool,
    share_prompts: bool = True,
    greedy: bool = False,
    keep_hidden: bool = False,
    logits_float32: bool = True,
    sample: Callable[[Tensor], Tensor] = multinomial,
    stop: tuple[str, ...] = (),
    head_chunk: int = 0,
    head_copy: bool = False,
    between_steps: Callable[[int], bool] | None = None,
) -> Samples:
    """Sample ``group_size`` responses per prompt and collect the sampling policy's log-probs and entropy.

    The decode loop (:func:`rlhf_lab.generation.decode.decode`, the same draws as ``model.generate``) computes
    the log-probs and entropies from the logits it samples with, so no second forward pass of the policy is
    needed for the old log-probs. With ``share_prompts`` each prompt is prefilled once, not once per sample:
    all but its last token run through the network for the unique prompts, the key/value cache is repeated
    to the ``group_size`` rows of each, and decoding continues from it. The logits equal the unshared run's
    to float precision. ``greedy`` decodes the most likely token at every position instead (ReMax's
    baseline response); ``keep_hidden`` keeps the last hidden state that predicted each response token
    (``Samples.hidden``, the shared PPO critic's input at sampling time); ``logits_float32=False`` keeps the
    LM head's own logits at temperature 1 (``Samples.policy_logits``, see
    :class:`rlhf_lab.generation.decode.Sampled`); ``sample`` draws each step's tokens; a response also ends where its
    text ends with one of ``stop`` (transformers' ``StopStringCriteria``; the stop string stays in the response);
    ``between_steps``: the decode's hook where weight updates land (:func:`~rlhf_lab.generation.decode.decode`).
    """
    device = next(model.parameters()).device
    encoded = left_padded(encode_prompts(tokenizer, prompts), tokenizer.pad_token_id)
    if encoded["input_ids"].shape[1] > max_prompt_tokens:
        check_prompt_lengths(encoded["attention_mask"].sum(-1).tolist(), max_prompt_tokens)
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, 0).to(device)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, 0).to(device)
    was_training = model.training
    model.eval()
    with gathered_once(model):  # FSDP: one all-gather of the weights for the whole generation, not one per token
        cache, cached = decode_cache(max_new_tokens), 0
        if agreed(model, share_prompts and group_size > 1 and encoded["input_ids"].shape[1] > 1):
            unique_ids, unique_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
            rows = torch.arange(unique_ids.shape[0], device=device).repeat_interleave(group_size)
            prefix = prefill_shared(model, unique_ids[:, :-1], unique_mask[:, :-1],
                                    position_ids_from_mask(unique_mask)[:, :-1], rows, past_key_values=cache)
            cache, cached = prefix.past_key_values, unique_ids.shape[1] - 1
        sampled = decode(model, prompt_ids, prompt_mask, cache, cached, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, greedy=greedy, keep_logits=keep_logits,
                         keep_hidden=keep_hidden, logits_float32=logits_float32, sample=sample, head_chunk=head_chunk,
                         head_copy=head_copy, between_steps=between_steps,
                         stopped=stop_strings(tokenizer, stop, prompt_width=prompt_ids.shape[1]) if stop else None)
    model.train(was_training)
    return decoded_samples(sampled, prompt_ids, prompt_mask, tokenizer.pad_token_id, group_size)


def decoded_samples(sampled: Sampled, prompt_ids: Tensor, prompt_mask: Tensor, pad_token_id: int,
                    group_size: int) -> Samples:
    """The engine's :class:`Samples` of a decode's ``sampled`` after ``prompt_ids`` [B, P]: the tokens after a row's
    end made the pad token and masked out of attention, the log-probs and entropies zero there."""
    response_ids = sampled.response_ids
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = (positions[None, :] < sampled.lengths[:, None]).float()
    response_ids = torch.where(response_mask.bool(), response_ids, pad_token_id)
    return Samples(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=response_mask,
        prompt_width=prompt_ids.shape[1],
        group_size=group_size,
        logprobs=sampled.logprobs * response_mask,
        entropy=sampled.entropy * response_mask,
        policy_logits=sampled.logits,
        hidden=sampled.hidden,
    )


_STOP_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {stop strings: criteria}
STOP_CACHE = 32  # stop-string lists kept per tokenizer, the least recently used dropped (a server's clients send any)


def stop_strings(tokenizer: Any, stop: tuple[str, ...], prompt_width: int) -> Callable[[Tensor], Tensor]:
    """[B, P + t] sequences -> [B] bool: the response (past the prompt's ``prompt_width``) ends with a stop string.

    The criteria are built once per tokenizer and stop strings (building one walks the whole vocabulary: about a
    second for SmolLM2's, which every generation call, every turn of an episode, would otherwise pay), the last
    ``STOP_CACHE`` lists kept."""
    built = _STOP_CRITERIA.setdefault(tokenizer, OrderedDict())
    if stop in built:
        built.move_to_end(stop)
    else:
        built[stop] = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stop))
        while len(built) > STOP_CACHE:
            built.popitem(last=False)
    criteria = built[stop]

    def stopped(sequences: Tensor) -> Tensor:
        if sequences.shape[1] <= prompt_width:
            return torch.zeros(sequences.shape[0], dtype=torch.bool, device=sequences.device)
        return criteria(sequences[:, prompt_width:], None)

    return stopped


@register("generation", "hf")
class HFGeneration(SamplesInPlace):
    """The :class:`~rlhf_lab.generation.backend.GenerationBackend` that decodes with the policy itself.

    ``keep_logits`` keeps the sampling policy's [B, T, V] logits on the rollout (the exact-KL diagnostic and the
    estimators that read them), ``keep_hidden`` the last hidden states (PPO's shared critic at sampling time),
    ``logits_float32`` whether the kept logits are float32 (see :func:`generate`); ``options`` (``cfg.generation``)
    has nothing for it. Every pass runs under the run's
    precision; the hardware profile may give the decode its own weights and draws (:mod:`rlhf_lab.hardware`).
    """

    trainer_logprobs = True  # its log-probs are the training model's own forward pass (in fp32, the trainer's numbers)

    def __init__(self, policy: nn.Module, tokenizer: Any, settings: SamplingSettings,
                 precision: Precision | None = None, hardware: HardwareProfile | None = None, options: Any = None,
                 keep_logits: bool = True, keep_hidden: bool = False, logits_float32: bool = True) -> None:
        self.policy, self.tokenizer, self.settings = policy, tokenizer, settings
        self.device = next(policy.parameters()).device
        self.precision = precision or Precision("fp32", self.device.type)
        if hardware is None:
            from rlhf_lab.hardware import HardwareProfile  # the plain path (its module reads the config schema)

            hardware = HardwareProfile()
        self.hardware = hardware
        self.keep_logits, self.keep_hidden, self.logits_float32 = keep_logits, keep_hidden, logits_float32
        self.head_chunk = 0  # > 0: kept logits stay the LM head's inputs (trainer.chunked_logprobs)
        self.head_copy = False  # those keep a copy of the head's weight (a batch scored after an update)
        # Where weight updates land between decode steps (set by the rollout worker for a block: in-flight updates)
        self.between_steps: Callable[[int], bool] | None = None

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Samples:
        """``group_size`` samples per prompt (see :class:`~rlhf_lab.generation.backend.GenerationBackend`)."""
        settings = settings or self.settings
        sample = self.hardware.sample
        if seeds is not None:  # one decode for every group, each group drawing from its own seeded stream
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: one seed per prompt group")
            sample = SeededDraws(sample, list(seeds), group_size, self.device)
        with self.precision.autocast(), self.hardware.decode_weights(self.policy, rows=len(prompts) * group_size):
            return self._generate(prompts, group_size, greedy, settings, sample)

    def _generate(self, prompts: list[Prompt], group_size: int, greedy: bool, settings: SamplingSettings,
                  sample: Callable[[Tensor], Tensor]) -> Samples:
        return generate(self.policy, self.tokenizer, prompts, group_size, settings.max_new_tokens,
                        settings.temperature, settings.top_p, settings.top_k, settings.max_prompt_tokens,
                        keep_logits=self.keep_logits and not greedy, greedy=greedy,
                        keep_hidden=self.keep_hidden and not greedy, logits_float32=self.logits_float32,
                        sample=sample, stop=settings.stop, head_chunk=self.head_chunk,
                        head_copy=self.head_copy, between_steps=self.between_steps)

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to copy: it samples with the policy's own weights."""

    def sleep(self, level: int = 2) -> None:
        """Nothing held between generations."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to take again."""
