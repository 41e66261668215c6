"""KL coefficient controllers (kind ``kl_controller``): classes ``Controller(coef, target=None, horizon=10000)``."""

from __future__ import annotations

import math

from rlhf_lab.registry import register


@register("kl_controller", "fixed")
class FixedKLController:
    """Constant coefficient β; ``update`` is a no-op (``target`` and ``horizon`` are ignored)."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        self.coef = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


@register("kl_controller", "adaptive")
class AdaptiveKLController(FixedKLController):
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2):

        e = clip(KL_current / KL_target − 1, −0.2, 0.2),    β ← β · (1 + e · n_steps / horizon)

    ``n_steps`` is the number of samples (episodes) the KL was measured over, ``horizon`` in the same unit.
    """

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        if target is None or not target > 0 or not math.isfinite(target):
            raise ValueError(f"adaptive KL controller needs a positive kl target; got target={target!r}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller needs a positive horizon; got horizon={horizon!r}")
        super().__init__(coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL: current_kl={current_kl}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + proportional_error * n_steps / self.horizon
