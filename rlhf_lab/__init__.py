"""rlhf_lab: Hydra-configured RLHF research (PPO, GRPO, REINFORCE/RLOO; KL estimators; rewards; LoRA).

Python API (:mod:`rlhf_lab.api`): ``rlhf_lab.compose(overrides) -> DictConfig`` and
``rlhf_lab.train(overrides_or_cfg, run_dir=None) -> summary``; loaded on first use, so ``import rlhf_lab`` stays light.
"""

import os
from typing import Any

__version__ = "0.1.0"

# Process settings rlhf_lab chooses where the environment does not: each is read once by a library torch loads,
# so they are set here, before torch. A value in the environment stands (the user's choice); DEFAULTED says
# which ones rlhf_lab set (the bench runs TRL with the libraries' own values, LIBRARY_DEFAULTS).
PROCESS_DEFAULTS = {
    # Tensors of 2 MiB and more on transparent huge pages (PyTorch's CPU-allocator switch; Linux with THP only):
    # the [B, T, V] logits and the optimizer state allocated afresh every step page-fault 512 times less (the
    # bench's reference pass 0.58 -> 0.42 s). THP_MEM_ALLOC_ENABLE=0 turns it off.
    "THP_MEM_ALLOC_ENABLE": "1",
    # oneDNN's matrix-product set-ups, which PyTorch's CPU kernels cache per input shape with their buffers, in
    # one entry instead of 1024: every step's prompts and responses have new lengths, and the heap grew ~15 MB a
    # step with them, ~6 now (20 steps of the bench's full fine-tuning: peak RSS 4128 -> 3936 MiB, same time and
    # numbers; experiments/BENCHMARK.md).
    "LRU_CACHE_CAPACITY": "1",
}
LIBRARY_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "0", "LRU_CACHE_CAPACITY": "1024"}  # what torch does without them
DEFAULTED = {name: name not in os.environ for name in PROCESS_DEFAULTS}
for _name, _value in PROCESS_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


def __getattr__(name: str) -> Any:
    if name in ("compose", "train"):
        from rlhf_lab import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlhf_lab' has no attribute {name!r}")
