"""How a run computes its passes, chosen by the config and the device: the LM-head chunking of the log-probs,
the token budget of micro-batches, padding-free packing.

Each choice changes memory and time only: the numbers of an update are the same either way (to float rounding;
see docs/concepts/architecture.md, "Invariance of the update"). A null option takes the device's default: what
fits a GPU under CUDA, what is fastest on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch


def head_chunk(trainer_cfg: Any, device: torch.device) -> int:
    """Positions per LM-head chunk for the log-probs, entropy and exact KL (``trainer.chunked_logprobs``,
    ``trainer.lm_head_chunk``); 0: the whole [B, T, V] logits (off; the CPU's default)."""
    chunked = trainer_cfg.get("chunked_logprobs")
    if chunked is None:
        chunked = device.type == "cuda"
    return int(trainer_cfg.get("lm_head_chunk", 1024)) if chunked else 0


def token_budget(trainer_cfg: Any) -> int:
    """``trainer.max_tokens_per_micro_batch`` (0: micro-batches by ``trainer.micro_batch_size`` rows)."""
    return int(trainer_cfg.get("max_tokens_per_micro_batch", 0) or 0)


def packs_rows(trainer_cfg: Any) -> bool:
    """Whether micro-batches are packed padding-free (``trainer.pack_rows``; null: where a token budget is set)."""
    pack = trainer_cfg.get("pack_rows")
    return bool(token_budget(trainer_cfg)) if pack is None else bool(pack)
