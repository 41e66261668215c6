"""The decode loop: sample responses and collect the sampling policy's per-token quantities as it goes.

It makes the same draws as ``model.generate(do_sample=True, ...)`` for a fixed seed: the same logits
processors (transformers' own ``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in generate's order), one ``torch.multinomial`` draw per step for
every row on the processed distribution, finished rows continued with the pad token, and the loop ends when
every row has produced an EOS or ``max_new_tokens`` are done. What it adds over ``generate``: each position's
log-probability and entropy come from that step's logits at once, so the [B, T, V] logits need not be kept
unless asked; it can keep the last hidden state that predicted each token (the shared PPO critic's input at
sampling time), which saves a forward pass over the rollout; its key/value cache
(:mod:`rlhf_lab.generation.kv_cache`) is written in place.

The policy distribution is ``softmax(raw logits / temperature)``, before top-k/top-p truncation (see
:mod:`rlhf_lab.generation.rollout`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_lab.generation.kv_cache import decode_cache
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.distributed import sharded
from rlhf_lab.scoring.draws import multinomial
from rlhf_lab.scoring.forward import gathered_by_fsdp, head_logits, plain_head
from rlhf_lab.scoring.logprobs import entropy_from_logits, gather_logprobs, scale_logits


@dataclass
class Sampled:
    """What the decode loop returns; T is the number of steps taken (≤ max_new_tokens)."""

    response_ids: Tensor  # [B, T] sampled tokens, pad after a row's EOS
    logprobs: Tensor  # [B, T] log softmax(logits / temperature) at the sampled token (unmasked); under top-k/top-p
    # truncation, of the truncated distribution the token was drawn from (:func:`truncates`)
    entropy: Tensor  # [B, T] entropy of softmax(logits / temperature) (unmasked)
    logits: Any  # [B, T, V] raw logits / temperature (a HeadLogits under ``head_chunk``), float32 (``keep_logits``; a view of a
    # [B, max_new_tokens, V] buffer when every row ended early); with ``logits_float32=False`` at temperature 1
    # the LM head's own logits (bf16 under autocast: the numbers whose float32 copy the sampler reads)
    hidden: Tensor | None  # [B, T, H] last hidden state that predicted each token (``keep_hidden``)
    lengths: Tensor | None = None  # [B] tokens of each response, its last one included (EOS or a stop string's)

def logits_processors(prompt_width: int, eos_token_id: int | list[int] | torch.Tensor | None, greedy: bool,
                      temperature: float,
                      top_k: int, top_p: float, min_new_tokens: int = 1) -> LogitsProcessorList:
    """The processors ``generate`` applies for these settings, in its order."""
    processors = LogitsProcessorList()
    if min_new_tokens > 0 and eos_token_id is not None:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_width, min_new_tokens, eos_token_id))
    if greedy:
        return processors
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


def truncates(top_k: int, top_p: float) -> bool:
    """Whether sampling draws from a truncated distribution (top-k or top-p): q = softmax(logits / T) restricted to
    the kept tokens and renormalised, not the policy's softmax(logits / T) (docs/guides/generation.md)."""
    return bool(top_k) or top_p < 1.0


def sampled_log_softmax(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """log q over the last dimension of temperature-scaled logits ``scaled`` [..., V]: the distribution a sampler
    with ``top_k`` / ``top_p`` draws from (the decode's own warpers, in its order; vLLM's ``processed_logprobs``),
    −inf outside the kept tokens. Without truncation, log softmax(``scaled``)."""
    flat = scaled.reshape(-1, scaled.shape[-1]).float()
    if top_k:
        flat = TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1)(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1)(None, flat.clone())
    return flat.log_softmax(-1).reshape(scaled.shape)


@contextmanager
def gathered_once(model: nn.Module) -> Iterator[None]:
    """Under FSDP2, the weights the block's first forward pass gathers stay gathered for every later pass, and are
    resharded when it ends: one all-gather per generation instead of one per decoded token. (Its memory: the whole
    model's weights for the generation's duration, as any engine that samples with them holds.) Elsewhere nothing.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for index, module in enumerate(modules):
            module.reshard()
            # fully_shard's default: every sharded block reshards after its forward, the root (first) does not.
            module.set_reshard_after_forward(index > 0, recurse=False)


@torch.no_grad()
def decode(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, past_key_values: Any, cached: int,
           max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos_token_id: int | list[int] | None,
           pad_token_id: int, greedy: bool = False, keep_logits: bool = False,
           keep_hidden: bool = False, logits_float32: bool = True, head_chunk: int = 0, head_copy: bool = False,
           sample: Callable[[Tensor], Tensor] = multinomial,
           stopped: Callable[[Tensor], Tensor] | None = None,
           between_steps: Callable[[int], bool] | None = None) -> Sampled:
    """Sample up to ``max_new_tokens`` tokens after left-padded prompts ``prompt_ids`` [B, P].

    ``past_key_values`` holds the first ``cached`` prompt positions of every row (0 with an empty cache);
    the rest of the prompt goes through the model in the first step. ``sample`` draws one token per row from
    the processed [B, V] probabilities (:func:`multinomial`; a hardware profile may give its own with the same
    draws); ``stopped`` (the sequences so far [B, P + t] -> [B] bool) ends a row besides its EOS (stop strings).
    With ``head_chunk`` > 0 and a plain LM head, ``keep_logits`` keeps the head's inputs instead of [B, T, V]
    logits (``Sampled.logits`` is then a :class:`~rlhf_lab.scoring.head.HeadLogits`, ``head_chunk`` positions
    at a time): no [B, T, V] buffer. It reads the head's weight when it is read; ``head_copy`` keeps a copy of
    it instead (for a batch read after an update of the weights; under FSDP2 always: its reshard frees them).
    ``between_steps(step)`` runs before each step after the first (an asynchronous engine's weight update lands
    there, :mod:`rlhf_lab.generation.inflight`); where it returns True the key/value cache is recomputed with the
    weights of now from every token so far (a partial rollout resumed), else the cache of the earlier weights is kept
    (an in-flight update).
    """
    decoding = Decoding(model, prompt_ids, prompt_mask, past_key_values, cached, max_new_tokens, temperature, top_p,
                        top_k, eos_token_id, pad_token_id, greedy=greedy, keep_logits=keep_logits,
                        keep_hidden=keep_hidden, logits_float32=logits_float32, head_chunk=head_chunk,
                        head_copy=head_copy, sample=sample, stopped=stopped)
    while not decoding.done and decoding.advance(
            bool(decoding.step and between_steps is not None and between_steps(decoding.step))):
        pass
    return decoding.result()


class Decoding:
    """One decode of a batch, a step at a time (:func:`decode`'s loop; see it for the arguments): :meth:`advance`
    samples one token for every row, :meth:`result` gives the :class:`Sampled`. An engine that decodes several
    batches at once, each from its own start (:mod:`rlhf_lab.generation.continuous`), advances each in turn, and
    weights that change between two of its steps land in it as they would in :func:`decode`'s ``between_steps``."""

    def __init__(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, past_key_values: Any, cached: int,
                 max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 eos_token_id: int | list[int] | Tensor | None, pad_token_id: int, greedy: bool = False,
                 keep_logits: bool = False, keep_hidden: bool = False, logits_float32: bool = True,
                 head_chunk: int = 0, head_copy: bool = False, sample: Callable[[Tensor], Tensor] = multinomial,
                 stopped: Callable[[Tensor], Tensor] | None = None) -> None:
        batch, prompt_width = prompt_ids.shape
        device = prompt_ids.device
        self.model, self.max_new_tokens, self.temperature = model, max_new_tokens, temperature
        self.greedy, self.keep_logits, self.keep_hidden = greedy, keep_logits, keep_hidden
        self.logits_float32, self.head_chunk, self.head_copy = logits_float32, head_chunk, head_copy
        self.sample, self.stopped, self.pad_token_id = sample, stopped, pad_token_id
        self.batch, self.prompt_width, self.device = batch, prompt_width, device
        # generate's minimum length of 1 sets the EOS scores to −inf at the first step; later it returns a copy of the
        # scores it is given (the same numbers), so the later steps run without it, and without any processor copy.
        self.eos_ids = torch.as_tensor([] if eos_token_id is None else eos_token_id, device=device).reshape(-1)
        # The processors get the EOS ids on the scores' device: given ints, transformers keeps them on the CPU, and a
        # GPU's first step then fails (``torch.isin`` across devices).
        eos = None if eos_token_id is None else self.eos_ids
        self.first_processors = logits_processors(prompt_width, eos, greedy, temperature, top_k, top_p)
        self.truncated = not greedy and truncates(top_k, top_p)
        self.later_processors = logits_processors(prompt_width, eos, greedy, temperature, top_k, top_p, 0)
        self.attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, max_new_tokens)], dim=1)
        # Positions skip left padding: the next position of each row is its count of real tokens so far.
        self.positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.next_position = prompt_mask.long().sum(-1, keepdim=True)
        self.sequences = prompt_ids
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.tokens: list[Tensor] = []
        self.logprobs: list[Tensor] = []
        self.entropies: list[Tensor] = []
        self.hidden_states: list[Tensor] = []
        self.kept_logits: Tensor | None = None  # [B, max_new_tokens, V], written step by step (see below)
        self.head = plain_head(model) if keep_logits and head_chunk > 0 else None
        self.head_inputs: list[Tensor] = []  # [B, H] per step: what the LM head read, in place of its [B, V] output
        self.hook = None if self.head is None else self.head.register_forward_pre_hook(
            lambda _module, args: self.head_inputs.append(args[0][:, -1]))
        self.past_key_values = past_key_values
        self.step_ids, self.step_positions = prompt_ids[:, cached:], self.positions[:, cached:]
        # Without autocast the model call runs in inference mode (no view or version bookkeeping, the same
        # numbers); under autocast inference mode would bypass autocast's cache of weight casts, and with sharded
        # parameters (FSDP's DTensors) the call gathers weights that later passes train through: those run under
        # no_grad. (Never ``inference_mode(False)``: it turns gradients back on, and every decode step's activations
        # would stay alive in an autograd graph, 4.7 GiB for a 1B Llama's 16 × 64 tokens.)
        self.sharded_weights = any(map(sharded, model.parameters()))
        self.step = 0  # the steps taken
        self.done = max_new_tokens <= 0

    @torch.no_grad()
    def advance(self, recompute: bool = False) -> bool:
        """Sample the next token of every row (pad after a row's end); ``recompute``: first compute the key/value
        cache again from every token so far with the weights of now (a partial rollout resumed after a weight
        update). Returns whether the decode goes on (a row unfinished and steps left)."""
        step, model, device = self.step, self.model, self.device
        width = self.prompt_width + step
        if step and recompute:  # the cache recomputed: every token so far
            self.past_key_values = decode_cache(self.max_new_tokens - step)
            self.step_ids = self.sequences
            self.step_positions = torch.cat([self.positions, self.next_position + torch.arange(step, device=device)],
                                            dim=1)
        inference = not torch.is_autocast_enabled(device.type) and not self.sharded_weights
        with torch.inference_mode() if inference else torch.no_grad():
            output = model(input_ids=self.step_ids, attention_mask=self.attention_mask[:, :width],
                           position_ids=self.step_positions, past_key_values=self.past_key_values, use_cache=True,
                           logits_to_keep=1, output_hidden_states=self.keep_hidden)
        self.past_key_values = output.past_key_values
        raw = output.logits[:, -1].float()  # [B, V]
        scaled = scale_logits(raw, self.temperature)
        processors = self.later_processors if step else self.first_processors
        scores = processors(self.sequences, raw.clone()) if processors else raw
        next_tokens = scores.max(-1).indices if self.greedy else self.sample(torch.softmax(scores, dim=-1))
        next_tokens = torch.where(self.unfinished, next_tokens, self.pad_token_id)
        # The sampled tokens' log-probs: of the distribution they were drawn from (the processed scores, as vLLM's
        # processed log-probs) where top-k/top-p truncate it; else softmax(logits / T), the trainer's own numbers.
        self.logprobs.append(gather_logprobs(scores if self.truncated else scaled, next_tokens))
        self.entropies.append(entropy_from_logits(scaled))
        if self.keep_logits and self.head is None:  # into one buffer: a list of [B, V] tensors stacked at the end
            # is a second full copy
            kept = scaled if self.logits_float32 or self.temperature != 1.0 else output.logits[:, -1]
            if self.kept_logits is None:
                self.kept_logits = kept.new_empty(self.batch, self.max_new_tokens, kept.shape[-1])
            self.kept_logits[:, step] = kept
        if self.keep_hidden:
            self.hidden_states.append(output.hidden_states[-1][:, -1])
        self.tokens.append(next_tokens)
        self.lengths += self.unfinished
        self.sequences = torch.cat([self.sequences, next_tokens[:, None]], dim=1)
        self.unfinished = self.unfinished & ~torch.isin(next_tokens, self.eos_ids)
        if self.stopped is not None:
            self.unfinished = self.unfinished & ~self.stopped(self.sequences)
        self.step = step + 1
        self.step_ids = next_tokens[:, None]
        self.step_positions = self.next_position + step
        # With sharded weights (FSDP) every forward pass gathers them from every rank: a rank whose rows have all
        # ended goes on (with pad tokens) until every rank's have.
        going = distributed.any_rank(bool(self.unfinished.any())) if self.sharded_weights else \
            bool(self.unfinished.any())
        self.done = not going or self.step >= self.max_new_tokens
        return not self.done

    def result(self) -> Sampled:
        """What the steps so far sampled (the decode's :class:`Sampled`)."""
        kept = self.kept_logits[:, : len(self.tokens)] if self.kept_logits is not None else None
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
            kept = head_logits(self.head, torch.stack(self.head_inputs, dim=1), self.temperature, self.head_chunk,
                               detach=True, copy=self.head_copy or gathered_by_fsdp(self.model))  # (not
            # sharded_weights: False where an earlier pass of the generation gathered them, as the shared prompts'
            # prefill does)
        return Sampled(
            response_ids=torch.stack(self.tokens, dim=1),
            logprobs=torch.stack(self.logprobs, dim=1),
            entropy=torch.stack(self.entropies, dim=1),
            logits=kept,
            hidden=torch.stack(self.hidden_states, dim=1) if self.keep_hidden else None,
            lengths=self.lengths,
        )
