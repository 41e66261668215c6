"""Generation and per-token quantities of a batch of sampled responses.

Layout: each row is ``[left padding | prompt | response | padding after EOS]``; the prompt part has the
same width P for every row (left padding), the response part width T. ``response_mask`` [B, T] is 1 on
response tokens up to and including the first EOS, 0 after it; it is built from the first EOS of each
response, never from ``token == pad_token_id`` (SmolLM2's pad token is its EOS token).

The policy's distribution is ``softmax(logits / temperature)``: the one sampled from (before top-p/top-k
truncation) and the one whose log-probabilities, entropies and KL the algorithms use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.generation_weights import generation_weights
from rlhf_lab.ops import scale_logits
from rlhf_lab.sampler import decode, decode_cache


def format_prompts(prompts: list[str], tokenizer: Any, chat_template: bool, system_prompt: str | None) -> list[str]:
    """Prompt strings as the model sees them: the chat template with a generation prompt, if it has one."""
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return list(prompts)
    formatted = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        formatted.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return formatted


def response_mask_from_tokens(response_ids: Tensor, eos_token_id: int | list[int] | None) -> Tensor:
    """1.0 on tokens up to and including the first EOS of each row, 0.0 after it: [B, T]."""
    batch, length = response_ids.shape
    if eos_token_id is None:
        return torch.ones(batch, length, dtype=torch.float32, device=response_ids.device)
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids)
    positions = torch.arange(length, device=response_ids.device).expand(batch, length)
    first_eos = torch.where(is_eos, positions, torch.full_like(positions, length)).min(dim=1).values
    return (positions <= first_eos[:, None]).float()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as generation uses them: cumsum(mask) − 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    """One step's samples and every per-token quantity computed from them.

    Rows are grouped: row i belongs to prompt i // group_size.
    """

    input_ids: Tensor  # [B, P+T] prompt (left padded) + response
    attention_mask: Tensor  # [B, P+T] 1 on prompt and valid response tokens
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P
    group_size: int
    logprobs: Tensor  # [B, T] sampling-time policy log-probs (the "old" policy)
    entropy: Tensor  # [B, T] full-vocabulary entropy of the sampling policy
    policy_logits: Tensor | None = None  # [B, T, V] sampling-time policy logits (temperature-scaled), in the
    # LM head's dtype or float32 as ref_logits
    hidden: Tensor | None = None  # [B, T, H] sampling-time last hidden states predicting each response token
    ref_logprobs: Tensor | None = None  # [B, T]
    ref_logits: Tensor | None = None  # [B, T, V] temperature-scaled; in the LM head's dtype at temperature 1
    # unless the KL estimator reads them (ExperienceMaker.logits_float32), else float32
    scores: Tensor | None = None  # [B] sequence rewards from the reward function
    kl_estimate: Tensor | None = None  # [B, T] the configured KL estimator's per-token value, masked
    kl_exact: Tensor | None = None  # [B, T] exact per-token KL from full logits (diagnostic), masked
    kl_penalty: Tensor | None = None  # [B, T] what the KL placement takes out of the token rewards
    kl_coef: float = 0.0  # the KL coefficient this rollout was scored with
    token_rewards: Tensor | None = None  # [B, T] built by the algorithm: score at the last token − kl_penalty
    advantages: Tensor | None = None  # [B, T]
    returns: Tensor | None = None  # [B, T] (critic targets)
    values: Tensor | None = None  # [B, T] (critic estimates at sampling time)
    old_logprobs: Tensor | None = None  # [B, T] π_old from a training pass (algorithm.tis_cap); None: logprobs
    tis_weights: Tensor | None = None  # [B, T] truncated importance weights π_train/π_sampler (tis_cap)
    baseline_scores: Tensor | None = None  # [B] the greedy response's score of each sample's prompt (ReMax)
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> Rollout:
        """A sub-batch with the given row indices (tensors indexed on dim 0, the rest shared)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.dim() > 0:
                value = value[rows]
            elif f.name == "extras":
                value = {k: v[rows] for k, v in value.items()}
            values[f.name] = value
        return Rollout(**values)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of each row's last valid response token: [B] (0 for an empty row)."""
    return (response_mask.sum(-1).long() - 1).clamp(min=0)


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence score on its last valid response token: [B] -> [B, T]."""
    token_rewards = torch.zeros_like(response_mask)
    token_rewards.scatter_(1, last_token_index(response_mask)[:, None], scores[:, None].to(token_rewards.dtype))
    return token_rewards * response_mask


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str],
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
) -> Rollout:
    """Sample ``group_size`` responses per prompt and collect the sampling policy's log-probs and entropy.

    The decode loop (:func:`rlhf_lab.sampler.decode`, the same draws as ``model.generate``) computes the
    log-probs and entropies from the logits it samples with, so no second forward pass of the policy is
    needed for the old log-probs. With ``share_prompts`` each prompt is prefilled once, not once per sample:
    all but its last token run through the network for the unique prompts, the key/value cache is repeated
    to the ``group_size`` rows of each, and decoding continues from it. The logits equal the unshared run's
    to float precision. ``greedy`` decodes the most likely token at every position instead (ReMax's
    baseline response); ``keep_hidden`` keeps the last hidden state that predicted each response token
    (``Rollout.hidden``, the shared PPO critic's input at sampling time); ``logits_float32=False`` keeps the
    LM head's own logits at temperature 1 (``Rollout.policy_logits``, see :class:`rlhf_lab.sampler.Sampled`).
    LoRA layers multiply by their
    merged weights while it samples, frozen layers by their autocast cast (:mod:`rlhf_lab.generation_weights`).
    """
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if encoded["input_ids"].shape[1] > max_prompt_tokens:
        lengths = encoded["attention_mask"].sum(-1)
        index = int(torch.argmax(lengths))
        raise ValueError(
            f"prompt {index} is {int(lengths[index])} tokens, over data.max_prompt_tokens={max_prompt_tokens}"
        )
    prompt_ids = encoded["input_ids"].repeat_interleave(group_size, 0).to(device)
    prompt_mask = encoded["attention_mask"].repeat_interleave(group_size, 0).to(device)
    was_training = model.training
    model.eval()
    with generation_weights(model, rows=prompt_ids.shape[0]):
        cache, cached = decode_cache(max_new_tokens), 0
        if share_prompts and group_size > 1 and encoded["input_ids"].shape[1] > 1:
            unique_ids, unique_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
            rows = torch.arange(unique_ids.shape[0], device=device).repeat_interleave(group_size)
            prefix = prefill_shared(model, unique_ids[:, :-1], unique_mask[:, :-1],
                                    position_ids_from_mask(unique_mask)[:, :-1], rows, past_key_values=cache)
            cache, cached = prefix.past_key_values, unique_ids.shape[1] - 1
        sampled = decode(model, prompt_ids, prompt_mask, cache, cached, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, greedy=greedy, keep_logits=keep_logits,
                         keep_hidden=keep_hidden, logits_float32=logits_float32)
    model.train(was_training)
    prompt_width = prompt_ids.shape[1]
    response_ids = sampled.response_ids
    response_mask = response_mask_from_tokens(response_ids, tokenizer.eos_token_id)
    # Tokens after the first EOS are padding: make them the pad token and mask them out of attention.
    response_ids = torch.where(response_mask.bool(), response_ids, tokenizer.pad_token_id)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_width=prompt_width,
        group_size=group_size,
        logprobs=sampled.logprobs * response_mask,
        entropy=sampled.entropy * response_mask,
        policy_logits=sampled.logits,
        hidden=sampled.hidden,
    )


def prefill_shared(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                   rows: Tensor, **kwargs: Any) -> Any:
    """Run each distinct prompt through ``model`` once and expand its key/value cache to ``rows``.

    ``rows[i]`` is the prompt that batch row ``i`` continues from. The returned output's logits (last
    position only) and hidden states are per prompt; its ``past_key_values`` are per row, ready for the
    continuation (generation, or the response tokens of a scoring pass). Indexing keeps the gradient path.
    """
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=True, logits_to_keep=1, **kwargs)
    output.past_key_values.batch_select_indices(rows)
    return output


# transformers' own switch: its SDPA attention passes the key/value heads to the kernel as they are
# (``enable_gqa``) instead of repeating them for every query head of their group.
GROUPED_KV_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def grouped_kv_attention(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Scoring passes on CPU attend with the grouped key/value heads as they are.

    Under a padding mask transformers' SDPA attention repeats each key/value head for the query heads of its
    group (``repeat_kv``: 3× the keys and values for SmolLM2's 9 query and 3 key/value heads), and a pass
    with gradients keeps those copies for its backward pass; inside, it hands the kernel the heads as they are
    (transformers' ``TRANSFORMERS_SDPA_FORCE_GQA``; PyTorch's CPU kernel takes a mask with them). The attention
    output is the same bit for bit; the key/value gradients are summed over a group inside the kernel, equal to
    the repeated heads' to float rounding (in float32 an ulp or two at 100+ positions; under bfloat16 autocast
    summed before rounding instead of after). Not on other devices (CUDA's kernels take the grouped heads only
    without a mask and fall back to the math kernel with one), not while a layer recomputes its forward in the
    backward pass (gradient checkpointing: the recomputation runs outside this context), and the environment's
    own setting stands. Generation does not use it: the decode loop's numbers stay ``generate``'s.
    """
    if device.type != "cpu" or GROUPED_KV_SWITCH in os.environ \
            or any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        yield
        return
    os.environ[GROUPED_KV_SWITCH] = "1"
    try:
        yield
    finally:
        del os.environ[GROUPED_KV_SWITCH]


def response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                    temperature: float, output_hidden_states: bool = False,
                    share_prompts: bool = True, float32: bool = True) -> tuple[Tensor, Tensor | None]:
    """Temperature-scaled logits predicting each response token: [B, T, V] (and last hidden states [B, T, H]).

    In float32, or with ``float32=False`` at temperature 1 in the LM head's own dtype (bfloat16 under autocast:
    the same numbers, without the [B, T, V] float32 copy, for a caller that upcasts them in chunks itself).

    Only the positions that predict response tokens go through the LM head (``logits_to_keep``). With
    ``share_prompts``, rows that share a prompt (the G samples of a group) run that prompt through the
    network once; its key/value cache is then indexed out to every row, and gradients flow back through
    it. The result equals the plain forward pass (see :func:`_plain_response_logits`) to float precision.
    Attention runs on the grouped key/value heads as they are where that applies (:func:`grouped_kv_attention`).
    """
    with grouped_kv_attention(model, input_ids.device):
        return _response_logits(model, input_ids, attention_mask, prompt_width, temperature, output_hidden_states,
                                share_prompts, float32)


def _response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                     temperature: float, output_hidden_states: bool, share_prompts: bool,
                     float32: bool) -> tuple[Tensor, Tensor | None]:
    prompt_ids = input_ids[:, :prompt_width]
    unique_prompts, row_to_prompt = torch.unique(prompt_ids, dim=0, return_inverse=True)
    if not share_prompts or unique_prompts.shape[0] == input_ids.shape[0] or input_ids.shape[1] == prompt_width:
        return _plain_response_logits(model, input_ids, attention_mask, prompt_width, temperature,
                                      output_hidden_states, float32)
    # One representative row per unique prompt.
    first_row = torch.full((unique_prompts.shape[0],), input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    first_row.scatter_reduce_(0, row_to_prompt, torch.arange(input_ids.shape[0], device=input_ids.device), "amin")
    positions = position_ids_from_mask(attention_mask)
    prefix = prefill_shared(model, prompt_ids[first_row], attention_mask[first_row, :prompt_width],
                            positions[first_row, :prompt_width], row_to_prompt,
                            output_hidden_states=output_hidden_states)
    cache = prefix.past_key_values
    first_logits = prefix.logits[:, -1:].index_select(0, row_to_prompt)
    # The last response token predicts nothing, so the continuation stops one short of the end.
    continuation = model(
        input_ids=input_ids[:, prompt_width:-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=positions[:, prompt_width:-1],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    logits = scale_logits(torch.cat([first_logits, continuation.logits], dim=1), temperature, float32)
    hidden = None
    if output_hidden_states:
        first_hidden = prefix.hidden_states[-1][:, -1:].index_select(0, row_to_prompt)
        hidden = torch.cat([first_hidden, continuation.hidden_states[-1]], dim=1)
    return logits, hidden


def _plain_response_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int,
                           temperature: float, output_hidden_states: bool = False,
                           float32: bool = True) -> tuple[Tensor, Tensor | None]:
    """One forward pass over every row's prompt and response (the reference computation)."""
    response_width = input_ids.shape[1] - prompt_width
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_width + 1,
        output_hidden_states=output_hidden_states,
        use_cache=False,
    )
    logits = scale_logits(output.logits[:, :-1], temperature, float32)
    hidden = output.hidden_states[-1][:, prompt_width - 1 : -1] if output_hidden_states else None
    return logits, hidden


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts generated separately into one batch: prompts left-padded to the widest prompt, responses
    right-padded to the longest (pad token, mask 0; per-token tensors 0 there). Rows keep their order; scores
    and reward components come along when the parts have them."""
    if len(parts) == 1:
        return parts[0]
    prompt_width = max(part.prompt_width for part in parts)
    response_width = max(part.response_mask.shape[1] for part in parts)

    def pad(tensor: Tensor, left: int, right: int, value: float = 0) -> Tensor:
        # F.pad pads the last dimensions first: move [B, T, V]'s T last, pad, move back.
        if tensor.dim() == 3:
            return torch.nn.functional.pad(tensor.transpose(1, 2), (left, right), value=value).transpose(1, 2)
        return torch.nn.functional.pad(tensor, (left, right), value=value)

    pieces: dict[str, list[Tensor]] = {key: [] for key in ("input_ids", "attention_mask", "response_mask",
                                                           "logprobs", "entropy", "policy_logits", "hidden", "scores")}
    for part in parts:
        left, right = prompt_width - part.prompt_width, response_width - part.response_mask.shape[1]
        prompt_ids, response_ids = part.input_ids[:, : part.prompt_width], part.response_ids
        pieces["input_ids"].append(torch.cat([pad(prompt_ids, left, 0, pad_token_id),
                                              pad(response_ids, 0, right, pad_token_id)], dim=1))
        prompt_mask, response_attention = part.attention_mask[:, : part.prompt_width], part.attention_mask[:, part.prompt_width :]
        pieces["attention_mask"].append(torch.cat([pad(prompt_mask, left, 0), pad(response_attention, 0, right)], dim=1))
        for key in ("response_mask", "logprobs", "entropy"):
            pieces[key].append(pad(getattr(part, key), 0, right))
        for key in ("policy_logits", "hidden"):
            if getattr(part, key) is not None:
                pieces[key].append(pad(getattr(part, key), 0, right))
        if part.scores is not None:
            pieces["scores"].append(part.scores)
    optional = {key: pieces.pop(key) for key in ("policy_logits", "hidden", "scores")}
    optional = {key: torch.cat(values) if getattr(parts[0], key) is not None else None
                for key, values in optional.items()}
    extras = {key: torch.cat([part.extras[key] for part in parts]) for key in parts[0].extras}
    return Rollout(prompt_width=prompt_width, group_size=parts[0].group_size, extras=extras, **optional,
                   **{key: torch.cat(values) for key, values in pieces.items()})
