"""The batch of sampled responses, one type per stage of a step, and its masks.

Each stage is made by one module and read by the next: what the engine returns (:class:`Samples`, frozen), what
the experience adds (:class:`Scored`, frozen: rewards, reference log-probs, KL terms, π_old's source), and the
training batch every algorithm trains on (:class:`Rollout`, frozen, made by the algorithm alone:
:meth:`~rlhf_lab.algorithms.base.Algorithm.training_batch` adds the advantages to :meth:`Scored.for_training`'s
fields; the update reads it).

Layout: each row is ``[left padding | prompt | response | padding after EOS]``; the prompt part has the
same width P for every row (left padding), the response part width T. ``response_mask`` [B, T] is 1 on
response tokens up to and including the first EOS, 0 after it; it is built from the first EOS of each
response, never from ``token == pad_token_id`` (SmolLM2's pad token is its EOS token).

A multi-turn trajectory (:mod:`rlhf_lab.envs`) is one row too: its response part holds every turn's sampled
tokens and the environment's tokens between them, as they were produced. There ``response_mask`` is the loss
mask, 1 on the model's tokens only (environment, tool and user tokens are context: attended to, never trained
on), so it has holes; ``attention_mask`` is 1 on every token of the trajectory.

The policy's distribution is ``softmax(logits / temperature)``: the one sampled from (before top-p/top-k
truncation) and the one whose log-probabilities, entropies and KL the algorithms use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


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

def _select_rows(batch: Any, rows: Tensor) -> dict[str, Any]:
    """The fields of ``batch`` (a dataclass of per-row values) for the given row indices: tensors indexed on dim 0,
    logits kept as the LM head's inputs by their own ``select_rows``, the ``extras`` dict entry by entry, the rest
    shared."""
    values = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, Tensor) and value.dim() > 0:
            value = value[rows]
        elif hasattr(value, "select_rows"):  # logits kept as the LM head's inputs (scoring.head.HeadLogits)
            value = value.select_rows(rows)
        elif f.name == "extras":
            value = {k: v[rows] for k, v in value.items()}
        values[f.name] = value
    return values


class _Rows:
    """What every stage reads off its rows: the response tokens (after the prompt's width) and the row count."""

    input_ids: Tensor
    prompt_width: int

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class Samples(_Rows):
    """What an engine returns (the first stage of a step, made by the engine alone): the sampled tokens, their
    masks and the sampling policy's own per-token numbers. Read by the experience, which makes a
    :class:`Scored` batch from it (:meth:`Scored.from_samples`); the engine's fields are never written after.

    Rows are grouped: row i belongs to prompt i // group_size.
    """

    input_ids: Tensor  # [B, P+T] prompt (left padded) + response
    attention_mask: Tensor  # [B, P+T] 1 on prompt and valid response tokens
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P
    group_size: int
    logprobs: Tensor  # [B, T] the engine's log-probs of the sampled tokens
    entropy: Tensor  # [B, T] full-vocabulary entropy of the sampling policy (zeros where the engine reports none)
    policy_logits: Tensor | None = None  # [B, T, V] sampling-time policy logits (temperature-scaled), in the
    # LM head's dtype or float32 (kept under ``engine.keep_logits``)
    hidden: Tensor | None = None  # [B, T, H] sampling-time last hidden states predicting each response token
    versions: Tensor | None = None  # [B, T] long: the updates of the weights that sampled each token (0 off it)

    def select(self, rows: Tensor) -> Samples:
        """The samples of the given row indices."""
        return Samples(**_select_rows(self, rows))


@dataclass(frozen=True)
class Scored(_Rows):
    """A batch of samples with what the experience adds (the second stage, made by :mod:`rlhf_lab.step.experience`
    alone, each pass's results put in with :func:`dataclasses.replace`): the rewards, the reference's log-probs,
    the KL terms, and where π_old and the entropy come from. ``logprobs`` is π_old: the engine's, or the training
    model's where the scoring pass rescored them (the engine's then in ``sampler_logprobs``). The algorithm reads
    it through the training batch made from it (:meth:`for_training`); it is never written after.
    """

    input_ids: Tensor  # [B, P+T]
    attention_mask: Tensor  # [B, P+T]
    response_mask: Tensor  # [B, T] float
    prompt_width: int
    group_size: int
    logprobs: Tensor  # [B, T] π_old
    entropy: Tensor  # [B, T]
    policy_logits: Tensor | None = None  # [B, T, V] until the scoring pass is done with them
    hidden: Tensor | None = None  # [B, T, H]
    scores: Tensor | None = None  # [B] sequence rewards (the environment's, or the reward function's, as shaped)
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B] reward components and environment counts
    turn_rewards: Tensor | None = None  # [B, T] multi-turn: each turn's reward on its last model token
    truncated: Tensor | None = None  # [B] bool, where the sampler knows it
    baseline_scores: Tensor | None = None  # [B] the greedy response's score (ReMax)
    ref_logprobs: Tensor | None = None  # [B, T]
    ref_logits: Tensor | None = None  # [B, T, V], kept only where the loss reads them
    kl_estimate: Tensor | None = None  # [B, T]
    kl_exact: Tensor | None = None  # [B, T]
    kl_penalty: Tensor | None = None  # [B, T]
    kl_coef: float = 0.0
    sampler_logprobs: Tensor | None = None  # [B, T] the engine's, where ``logprobs`` are the trainer's
    old_from_update: bool = False
    entropy_from_update: bool = False
    versions: Tensor | None = None  # [B, T] the sampling weights' updates per token (:class:`Samples`)

    @classmethod
    def from_samples(cls, samples: Samples, **added: Any) -> Scored:
        """The engine's ``samples`` with the first fields the experience adds (``scores``, ``extras``...)."""
        return cls(**{f.name: getattr(samples, f.name) for f in fields(Samples)}, **added)

    def select(self, rows: Tensor) -> Scored:
        """The batch's rows ``rows``."""
        return Scored(**_select_rows(self, rows))

    def for_training(self) -> Rollout:
        """The training batch (:class:`Rollout`) of these samples: every field carried over; the algorithm's
        :meth:`~rlhf_lab.algorithms.base.Algorithm.training_batch` makes it and adds the advantages."""
        return Rollout(**{f.name: getattr(self, f.name) for f in fields(Scored)})


@dataclass(frozen=True)
class Rollout(_Rows):
    """The training batch (frozen): a :class:`Scored` batch's fields (:meth:`Scored.for_training`) and what the
    algorithm adds (``token_rewards``, ``advantages``, ``returns``, PPO's ``values``, ``tis_weights``,
    ``kl_loss_scale``; :meth:`~rlhf_lab.algorithms.base.Algorithm.training_batch`, with :func:`dataclasses.replace`).
    The offline stages build it from data (:mod:`rlhf_lab.offline.batch`) and add a reference pass the same way.

    Rows are grouped: row i belongs to prompt i // group_size.
    """

    input_ids: Tensor  # [B, P+T] prompt (left padded) + response
    attention_mask: Tensor  # [B, P+T] 1 on prompt and valid response tokens
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P
    group_size: int
    logprobs: Tensor  # [B, T] π_old: the sampling policy's log-probs (the training model's where it rescored them)
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
    sampler_logprobs: Tensor | None = None  # [B, T] the engine's own log-probs where ``logprobs`` are the trainer's
    tis_weights: Tensor | None = None  # [B, T] the sampler-trainer correction's weights (algorithm.tis_cap)
    kl_loss_scale: Tensor | None = None  # [B] the factor the advantages gave each sample's task reward
    old_from_update: bool = False  # π_old is the training pass's own detached log-probs (one update per rollout)
    entropy_from_update: bool = False  # ``entropy`` is filled by the training pass (an engine with no logits)
    baseline_scores: Tensor | None = None  # [B] the greedy response's score of each sample's prompt (ReMax)
    turn_rewards: Tensor | None = None  # [B, T] multi-turn: each turn's reward on its last model token (their
    # sum is ``scores``); the token rewards start from these instead of the score on the last token
    truncated: Tensor | None = None  # [B] bool, where the sampler knows it (multi-turn: the episode did not end)
    extras: dict[str, Tensor] = field(default_factory=dict)
    versions: Tensor | None = None  # [B, T] long: the updates of the weights that sampled each token (0 off it)

    def old_logprobs(self, logprobs: Tensor) -> Tensor:
        """π_old for a training pass that computed ``logprobs``: themselves, detached, where the rollout gets one
        update whose numbers the sampler's may not match (``old_from_update``); else the rollout's ``logprobs``."""
        return logprobs.detach() if self.old_from_update else self.logprobs

    def select(self, rows: Tensor) -> Rollout:
        """A sub-batch with the given row indices (tensors indexed on dim 0, the rest shared)."""
        return Rollout(**_select_rows(self, rows))

def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of each row's last valid response token: [B] (0 for an empty row; a mask with holes, a multi-turn
    trajectory's, counts its last model token)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return torch.where(response_mask > 0, positions, -1).max(-1).values.clamp(min=0)

def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence score on its last valid response token: [B] -> [B, T]."""
    token_rewards = torch.zeros_like(response_mask)
    token_rewards.scatter_(1, last_token_index(response_mask)[:, None], scores[:, None].to(token_rewards.dtype))
    return token_rewards * response_mask

def task_token_rewards(rollout: Rollout, scores: Tensor) -> Tensor:
    """The task's reward per token: each turn's reward on its last model token (multi-turn), else ``scores``
    [B] on the last valid token: [B, T]."""
    if rollout.turn_rewards is not None:
        return rollout.turn_rewards * rollout.response_mask
    return scores_to_token_rewards(scores, rollout.response_mask)

def concat_rollouts(parts: list[Any], pad_token_id: int) -> Any:
    """Stack rollouts generated separately into one batch: prompts left-padded to the widest prompt, responses
    right-padded to the longest (pad token, mask 0; per-token tensors 0 there). Rows keep their order; scores
    and reward components come along when the parts have them. The parts are all :class:`Samples` (an engine's
    batches) or all :class:`Rollout`; the result is of their class."""
    if len(parts) == 1:
        return parts[0]
    prompt_width = max(part.prompt_width for part in parts)
    response_width = max(part.response_mask.shape[1] for part in parts)

    def pad(tensor: Tensor, left: int, right: int, value: float = 0) -> Tensor:
        # F.pad pads the last dimensions first: move [B, T, V]'s T last, pad, move back.
        if hasattr(tensor, "select_rows"):  # a HeadLogits: pad its hidden states [B, T, H]
            return replace(tensor, hidden=pad(tensor.hidden, left, right, value))
        if tensor.dim() == 3:
            return torch.nn.functional.pad(tensor.transpose(1, 2), (left, right), value=value).transpose(1, 2)
        return torch.nn.functional.pad(tensor, (left, right), value=value)

    pieces: dict[str, list[Tensor]] = {key: [] for key in ("input_ids", "attention_mask", "response_mask",
                                                           "logprobs", "entropy", "policy_logits", "hidden", "scores",
                                                           "turn_rewards", "truncated", "versions")}
    for part in parts:
        left, right = prompt_width - part.prompt_width, response_width - part.response_mask.shape[1]
        prompt_ids, response_ids = part.input_ids[:, : part.prompt_width], part.response_ids
        pieces["input_ids"].append(torch.cat([pad(prompt_ids, left, 0, pad_token_id),
                                              pad(response_ids, 0, right, pad_token_id)], dim=1))
        prompt_mask, response_attention = part.attention_mask[:, : part.prompt_width], part.attention_mask[:, part.prompt_width :]
        pieces["attention_mask"].append(torch.cat([pad(prompt_mask, left, 0), pad(response_attention, 0, right)], dim=1))
        for key in ("response_mask", "logprobs", "entropy"):
            pieces[key].append(pad(getattr(part, key), 0, right))
        for key in ("policy_logits", "hidden", "turn_rewards", "versions"):
            if getattr(part, key, None) is not None:
                pieces[key].append(pad(getattr(part, key), 0, right))
        for key in ("scores", "truncated"):
            if getattr(part, key, None) is not None:
                pieces[key].append(getattr(part, key))
    kind = type(parts[0])
    names = {f.name for f in fields(kind)}
    optional = {key: pieces.pop(key) for key in ("policy_logits", "hidden", "scores", "turn_rewards", "truncated",
                                                 "versions")}
    optional = {key: (values[0].cat(values) if hasattr(values[0], "select_rows") else torch.cat(values))
                if getattr(parts[0], key) is not None else None for key, values in optional.items() if key in names}
    if "extras" in names:
        optional["extras"] = {key: torch.cat([part.extras[key] for part in parts]) for key in parts[0].extras}
    return kind(prompt_width=prompt_width, group_size=parts[0].group_size, **optional,
                **{key: torch.cat(values) for key, values in pieces.items()})
