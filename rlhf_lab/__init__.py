"""rlhf_lab: Hydra-configured RLHF research (PPO, GRPO, REINFORCE/RLOO; KL estimators; rewards; LoRA).

Python API (:mod:`rlhf_lab.app.api`): ``rlhf_lab.compose(overrides) -> DictConfig`` and
``rlhf_lab.train(overrides_or_cfg, run_dir=None) -> summary``; loaded on first use, so ``import rlhf_lab`` stays
light. Importing the package, or any module of it, changes nothing in the process: no environment variable, no
allocator or thread setting, no global torch state. A run applies what its hardware profile asks for
(:mod:`rlhf_lab.hardware`).
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("compose", "train"):
        from rlhf_lab.app import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlhf_lab' has no attribute {name!r}")
