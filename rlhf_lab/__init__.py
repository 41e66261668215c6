"""rlhf_lab: Hydra-configured RLHF research (PPO, GRPO, REINFORCE/RLOO; KL estimators; rewards; LoRA).

Python API (:mod:`rlhf_lab.api`): ``rlhf_lab.compose(overrides) -> DictConfig`` and
``rlhf_lab.train(overrides_or_cfg, run_dir=None) -> summary``; loaded on first use, so ``import rlhf_lab`` stays light.
"""

import os
from typing import Any

__version__ = "0.1.0"

# Tensors of 2 MiB and more on transparent huge pages: PyTorch's own CPU-allocator switch, read once at its
# first allocation, so it is set here, before torch loads (no effect where torch allocated first, off Linux,
# or with THP disabled). The [B, T, V] logits and the optimizer state are allocated afresh every step and
# page-fault 512 times less: the reference pass of the bench's GRPO step 0.58 -> 0.42 s (experiments/
# BENCHMARK.md). THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
THP_ENV = "THP_MEM_ALLOC_ENABLE"
THP_DEFAULTED = THP_ENV not in os.environ  # True: rlhf_lab chose it (the bench runs TRL without it)
os.environ.setdefault(THP_ENV, "1")


def __getattr__(name: str) -> Any:
    if name in ("compose", "train"):
        from rlhf_lab import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlhf_lab' has no attribute {name!r}")
