"""Pooling a sequence classifier's hidden states into one reward per sequence, shared by reward-model
training (rlhf_lab/offline/reward_model.py) and scoring (``reward=reward_model``), so both read a text the
same way. A model trained here records its pooling in ``config.pooling``; other models keep their own head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.scoring.forward import position_ids_from_mask

POOLINGS = ("last", "mean")


def pool(hidden: Tensor, attention_mask: Tensor, pooling: str) -> Tensor:
    """[B, L, H] -> [B, H]: the last token with attention mask 1 (``last``; under left or right padding) or
    the mean over the tokens with mask 1 (``mean``). Masks, never pad ids: the pad token may be EOS."""
    mask = attention_mask.to(hidden.dtype)
    if pooling == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    if pooling != "last":
        raise ValueError(f"pooling={pooling!r} is not valid; choose from: {', '.join(POOLINGS)}")
    positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    last = (positions * attention_mask.long()).argmax(-1)  # the rightmost real token
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def sequence_rewards(model: Any, input_ids: Tensor, attention_mask: Tensor, pooling: str | None = None) -> Tensor:
    """One reward per row [B] (float32). With ``pooling`` (or the model's ``config.pooling``) and a ``score``
    head on a causal-LM trunk, the trunk's last hidden states are pooled and scored; otherwise the model's
    own forward (its first logit)."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    pooling = pooling or getattr(hf_model.config, "pooling", None)
    head = getattr(hf_model, "score", None)
    if pooling is None or head is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()
    trunk = getattr(hf_model, hf_model.base_model_prefix)
    hidden = trunk(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return head(pool(hidden, attention_mask, pooling))[:, 0].float()
