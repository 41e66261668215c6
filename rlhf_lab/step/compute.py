"""How a run computes its passes, chosen by the config and the device: the LM-head chunking of the log-probs,
the token budget of micro-batches, padding-free packing.

Each choice changes memory and time only: the numbers of an update are the same either way (to float rounding;
see docs/concepts/architecture.md, "Invariance of the update"). A null option takes the device's default: what
fits a GPU under CUDA, what is fastest on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.runtime import distributed
from rlhf_lab.scoring.packing import row_tokens, split_to, token_budget_groups


def head_chunk(trainer_cfg: Any, device: torch.device) -> int:
    """Positions per LM-head chunk for the log-probs, entropy and exact KL (``trainer.chunked_logprobs``,
    ``trainer.lm_head_chunk``); 0: the whole [B, T, V] logits (off; the CPU's default)."""
    chunked = trainer_cfg.get("chunked_logprobs")
    if chunked is None:
        chunked = device.type == "cuda"
    return int(trainer_cfg.get("lm_head_chunk", 1024)) if chunked else 0


GPU_TOKEN_BUDGET = 16384  # tokens per micro-batch under CUDA when trainer.max_tokens_per_micro_batch is null


def gradient_checkpointing(trainer_cfg: Any, device: torch.device) -> bool:
    """``trainer.gradient_checkpointing``; null: on under CUDA (activations are most of a GPU step's memory), off on
    the CPU (where recomputing every layer costs more time than the memory is worth)."""
    enabled = trainer_cfg.get("gradient_checkpointing")
    return device.type == "cuda" if enabled is None else bool(enabled)


def token_budget(trainer_cfg: Any, device: torch.device) -> int:
    """``trainer.max_tokens_per_micro_batch``; 0: micro-batches by ``trainer.micro_batch_size`` rows; null:
    :data:`GPU_TOKEN_BUDGET` under CUDA, 0 on the CPU."""
    budget = trainer_cfg.get("max_tokens_per_micro_batch")
    if budget is None:
        return GPU_TOKEN_BUDGET if device.type == "cuda" else 0
    return int(budget)


# Attention implementations that run a packed sequence as variable-length rows. Under the others (``sdpa``,
# ``eager``) transformers masks a packed sequence of N tokens with a dense [N, N] block-diagonal mask: the attention
# then costs N² (every row against every other, masked out) instead of the rows' own T², in time and in memory,
# which a GPU's fused kernels widen per head (a 1B step at a 16k-token budget ran out of 140 GB on an H200).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def attention_implementation(model: nn.Module) -> str | None:
    """The attention transformers runs in ``model`` (``config._attn_implementation``), None where unknown."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "_attn_implementation", None)


def packs_rows(trainer_cfg: Any, device: torch.device, attention: str | None = None) -> bool:
    """Whether micro-batches are packed padding-free (``trainer.pack_rows``; null: where a token budget is set and
    the model's attention runs variable-length rows, :data:`VARLEN_ATTENTION`; else padded rows)."""
    pack = trainer_cfg.get("pack_rows")
    if pack is not None:
        return bool(pack)
    return bool(token_budget(trainer_cfg, device)) and attention in VARLEN_ATTENTION


def micro_batches(attention_mask: Tensor, rows: int, budget: int, agree: bool, stretch: bool = False,
                  padded: bool = False) -> list[Tensor]:
    """The row indices of each micro-batch of a batch: up to ``budget`` tokens each where ``budget`` > 0, else
    ``rows`` rows each (0: all). A packed pass (padding-free) counts each row's attended tokens (prompt +
    response, :func:`~rlhf_lab.scoring.packing.token_budget_groups`); a ``padded`` one the positions it computes,
    the batch's width per row, so the budget bounds a pass's activations either way. ``stretch``: a default budget,
    raised to the longest row (a budget the user set that is smaller is an error). ``agree``: every rank runs as
    many (sharded weights make each forward a collective), the smaller counts split further."""
    batch = attention_mask.shape[0]
    if not budget:
        size = rows or batch
        return [torch.arange(start, min(start + size, batch)) for start in range(0, batch, size)]
    tokens = [attention_mask.shape[1]] * batch if padded else row_tokens(attention_mask).tolist()
    if stretch:
        budget = max([budget, *tokens])
    groups = token_budget_groups(tokens, budget)
    if agree and distributed.world_size() > 1:
        groups = split_to(groups, int(distributed.maximum(torch.tensor(float(len(groups))))))
    return [torch.tensor(group, dtype=torch.long) for group in groups]
