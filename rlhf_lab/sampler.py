"""The decode loop: sample responses and collect the sampling policy's per-token quantities as it goes.

It makes the same draws as ``model.generate(do_sample=True, ...)`` for a fixed seed: the same logits
processors (transformers' own ``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in generate's order), ``torch.multinomial``'s draw on the
processed distribution once per step for every row, finished rows continued with the pad token, and the loop
ends when every row has produced an EOS or ``max_new_tokens`` are done. What it saves over ``generate``: its
per-step bookkeeping (model-kwarg updates, stopping-criteria objects, tuples of per-step outputs stacked at
the end), most of the time of multinomial's draw (:func:`sample_tokens`: the same random numbers, turned
into exponential ones only for the tokens that can win), and it computes each position's log-probability
and entropy from that step's logits at once, so the [B, T, V] logits need not be kept unless asked. It can
also keep the last hidden state that predicted each token (the shared PPO critic's input at sampling time),
which saves a forward pass over the rollout. Its key/value cache (:func:`decode_cache`) holds the dynamic
cache's numbers without copying them at every step.

The policy distribution is ``softmax(raw logits / temperature)``, before top-k/top-p truncation (see
:mod:`rlhf_lab.rollout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from rlhf_lab.distributed import sharded
from rlhf_lab.ops import entropy_from_logits, gather_logprobs, scale_logits


@dataclass
class Sampled:
    """What the decode loop returns; T is the number of steps taken (≤ max_new_tokens)."""

    response_ids: Tensor  # [B, T] sampled tokens, pad after a row's EOS
    logprobs: Tensor  # [B, T] log softmax(logits / temperature) at the sampled token (unmasked)
    entropy: Tensor  # [B, T] entropy of softmax(logits / temperature) (unmasked)
    logits: Tensor | None  # [B, T, V] raw logits / temperature, float32 (``keep_logits``; a view of a
    # [B, max_new_tokens, V] buffer when every row ended early); with ``logits_float32=False`` at temperature 1
    # the LM head's own logits (bf16 under autocast: the numbers whose float32 copy the sampler reads)
    hidden: Tensor | None  # [B, T, H] last hidden state that predicted each token (``keep_hidden``)


def logits_processors(prompt_width: int, eos_token_id: int | list[int] | None, greedy: bool, temperature: float,
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


# A float64 draw this close (relatively) to a float32 rounding boundary is recomputed by the C library's log1p.
_UNSURE = 2.0**-48


def draws_from_uniform(uniform: Tensor) -> Tensor:
    """Exp(1) draws in float32 from float64 uniforms ``u``: the numbers ``exponential_`` makes, vectorised.

    PyTorch's CPU ``exponential_`` takes a 53-bit uniform u per element (``uniform_`` in float64 consumes the
    generator the same way), computes −log1p(−u) in float64 with the C library's ``log1p``, one element at a
    time under the generator's lock, and rounds to float32. PyTorch's ``log1p`` is within an ulp of the C
    library's, so the two round to the same float32 unless the value lies within a few ulps of a rounding
    boundary (about one draw in 10⁸); those are recomputed with ``math.log1p``, the C library's. A zero draw
    (u = 0) is +0 either way: the vectorised ``log1p`` keeps the sign of −0 (tested).
    """
    exact = torch.log1p(uniform.neg()).neg_()
    draws = exact.float()
    unsure = (exact * (1 - _UNSURE)).float() != (exact * (1 + _UNSURE)).float()
    if bool(unsure.any()):
        index = unsure.nonzero(as_tuple=True)
        draws[index] = torch.tensor([-math.log1p(-u) for u in uniform[index].tolist()], dtype=draws.dtype)
    return draws


# A token's ratio float32(p / float32(−log1p(−u))) never exceeds its bound float32(p / float32(u)): −log1p(−u)
# ≥ u, the C library's log1p (faithfully rounded) keeps that in float64, and rounding to float32 is monotone.
# Tokens whose bound falls below the best exact ratio found therefore cannot win; the margin is kept against a
# log1p an ulp off.
_BOUND_MARGIN = 2.0**-20


def sample_tokens(probs: Tensor) -> Tensor:
    """``torch.multinomial(probs, 1).squeeze(1)`` for [B, V] ``probs``: the same token per row from the same
    random numbers. For one sample multinomial takes the first argmax of p / q in float32, with q ~ Exp(1)
    drawn by ``exponential_`` (float32(−log1p(−u)) for a float64 uniform u per entry, see
    :func:`draws_from_uniform`). On CPU in float32 the uniforms are drawn alike, but q is computed only where
    the token can win: since q ≥ u, p / u bounds the ratio from above, so the exact ratio of each row's best
    p / u sets a threshold, and only the entries whose bound reaches it (about one a row) get their exact q.
    A NaN bound (p = 0 at a zero draw, which multinomial's argmax would pick) sends the whole batch down the
    full path. Invalid rows (inf, nan, a negative entry, a zero sum) go to multinomial itself, which refuses
    them before drawing.
    """
    fast = probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
    if not fast or not bool((probs.max() < math.inf) & (probs.min() >= 0) & (probs.sum(-1) > 0).all()):
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    uniform = torch.empty(probs.shape, dtype=torch.float64).uniform_()
    bound = uniform.float()
    bound = torch.div(probs, bound, out=bound)  # u ≥ 2⁻⁵³ (or 0) is a normal float32, the quotient is ≤ 2⁵³
    best_bound, best = bound.max(-1, keepdim=True)  # argmax's index (the first NaN, else the first maximum)
    if bool(best_bound.isnan().any()):
        return (probs / draws_from_uniform(uniform)).argmax(-1)
    best_ratio = probs.gather(-1, best) / draws_from_uniform(uniform.gather(-1, best))  # exact, float32
    rows, cols = (bound >= best_ratio * (1 - _BOUND_MARGIN)).nonzero(as_tuple=True)
    ratio = probs[rows, cols] / draws_from_uniform(uniform[rows, cols])
    return first_argmax(ratio, rows, cols, probs.shape)


def first_argmax(values: Tensor, rows: Tensor, cols: Tensor, shape: torch.Size) -> Tensor:
    """The argmax of each row of a [B, V] tensor of ``shape`` that holds ``values`` at (``rows``, ``cols``)
    and −inf elsewhere (no NaN among them, every row holding one at least): the lowest column holding the
    row's largest value, as ``argmax`` picks among ties, from the few entries alone."""
    batch, width = shape
    top = values.new_full((batch,), -math.inf).scatter_reduce_(0, rows, values, "amax")
    winners = torch.where(values == top[rows], cols, width)
    return cols.new_full((batch,), width).scatter_reduce_(0, rows, winners, "amin")


class DecodeLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with the same keys and values, kept where the decode reads them cheaply.

    - The keys and values are written into buffers with room for ``reserve`` more positions, and returned as
      views of them: no step copies the whole cache again (``DynamicLayer`` concatenates at every step).
    - Under autocast the keys arrive in float32 (rotary's float32 cos/sin promote them) beside values in the
      autocast dtype, and attention casts the whole key cache down again at every step; here each key is
      stored in the values' dtype once, the cast attention would make. Attention then gets the same numbers.
    """

    def __init__(self, reserve: int) -> None:
        super().__init__()
        self.reserve = reserve
        self.buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        device_type = key_states.device.type
        if (key_states.dtype != value_states.dtype and torch.is_autocast_enabled(device_type)
                and value_states.dtype == torch.get_autocast_dtype(device_type)):
            key_states = key_states.to(value_states.dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._writes_in_place(key_states, value_states, end):
            shape = (*key_states.shape[:2], end + self.reserve)
            keys = key_states.new_empty(*shape, key_states.shape[-1])
            values = value_states.new_empty(*shape, value_states.shape[-1])
            if length:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self.buffers = (keys, values)
        keys, values = self.buffers
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _writes_in_place(self, key_states: Tensor, value_states: Tensor, end: int) -> bool:
        """Whether the cached keys and values are the leading part of buffers that hold ``end`` positions (not
        after ``batch_select_indices`` and the like, which put new tensors in their place)."""
        if self.buffers is None:
            return False
        keys, values = self.buffers
        return (self.keys.data_ptr() == keys.data_ptr() and self.values.data_ptr() == values.data_ptr()
                and keys.shape[:2] == key_states.shape[:2] and keys.shape[-2] >= end
                and keys.dtype == key_states.dtype and values.dtype == value_states.dtype)


def decode_cache(reserve: int) -> DynamicCache:
    """An empty key/value cache of :class:`DecodeLayer` layers, each keeping room for ``reserve`` positions
    past the ones it holds when it (re)allocates (the decode's ``max_new_tokens``)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(DecodeLayer, reserve)
    return cache


@torch.no_grad()
def decode(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, past_key_values: Any, cached: int,
           max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos_token_id: int | list[int] | None,
           pad_token_id: int, greedy: bool = False, keep_logits: bool = False,
           keep_hidden: bool = False, logits_float32: bool = True) -> Sampled:
    """Sample up to ``max_new_tokens`` tokens after left-padded prompts ``prompt_ids`` [B, P].

    ``past_key_values`` holds the first ``cached`` prompt positions of every row (0 with an empty cache);
    the rest of the prompt goes through the model in the first step.
    """
    batch, prompt_width = prompt_ids.shape
    device = prompt_ids.device
    # generate's minimum length of 1 sets the EOS scores to −inf at the first step; later it returns a copy of the
    # scores it is given (the same numbers), so the later steps run without it, and without any processor copy.
    first_processors = logits_processors(prompt_width, eos_token_id, greedy, temperature, top_k, top_p)
    later_processors = logits_processors(prompt_width, eos_token_id, greedy, temperature, top_k, top_p, 0)
    eos_ids = torch.as_tensor([] if eos_token_id is None else eos_token_id, device=device).reshape(-1)
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, max_new_tokens)], dim=1)
    # Positions skip left padding: the next position of each row is its count of real tokens so far.
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    next_position = prompt_mask.long().sum(-1, keepdim=True)
    sequences = prompt_ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    tokens, logprobs, entropies, hidden_states = [], [], [], []
    kept_logits = None  # [B, max_new_tokens, V], written step by step (see below)
    step_ids, step_positions = prompt_ids[:, cached:], positions[:, cached:]
    # Without autocast the model call runs in inference mode (no view or version bookkeeping: 3–7% of a decode
    # step here, the same numbers); under autocast inference mode would bypass autocast's cache of weight casts,
    # and with sharded parameters (FSDP's DTensors) the call gathers weights that later passes train through.
    inference = not torch.is_autocast_enabled(device.type) and not any(map(sharded, model.parameters()))
    for step in range(max_new_tokens):
        width = prompt_width + step
        with torch.inference_mode(inference):
            output = model(input_ids=step_ids, attention_mask=attention_mask[:, :width], position_ids=step_positions,
                           past_key_values=past_key_values, use_cache=True, logits_to_keep=1,
                           output_hidden_states=keep_hidden)
        past_key_values = output.past_key_values
        raw = output.logits[:, -1].float()  # [B, V]
        scaled = scale_logits(raw, temperature)
        processors = later_processors if step else first_processors
        scores = processors(sequences, raw.clone()) if processors else raw
        next_tokens = scores.max(-1).indices if greedy else sample_tokens(torch.softmax(scores, dim=-1))
        next_tokens = torch.where(unfinished, next_tokens, pad_token_id)
        logprobs.append(gather_logprobs(scaled, next_tokens))
        entropies.append(entropy_from_logits(scaled))
        if keep_logits:  # into one buffer: a list of [B, V] tensors stacked at the end is a second full copy
            kept = scaled if logits_float32 or temperature != 1.0 else output.logits[:, -1]
            if kept_logits is None:
                kept_logits = kept.new_empty(batch, max_new_tokens, kept.shape[-1])
            kept_logits[:, step] = kept
        if keep_hidden:
            hidden_states.append(output.hidden_states[-1][:, -1])
        tokens.append(next_tokens)
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        unfinished = unfinished & ~torch.isin(next_tokens, eos_ids)
        if not bool(unfinished.any()):
            break
        step_ids = next_tokens[:, None]
        step_positions = next_position + step
    return Sampled(
        response_ids=torch.stack(tokens, dim=1),
        logprobs=torch.stack(logprobs, dim=1),
        entropy=torch.stack(entropies, dim=1),
        logits=kept_logits[:, : len(tokens)] if keep_logits else None,
        hidden=torch.stack(hidden_states, dim=1) if keep_hidden else None,
    )
