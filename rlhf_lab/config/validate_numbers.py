"""Numbers and the device: NaN and infinity, integer ranges, LoRA's dropout, a device that is not there.

A comparison with NaN is false, so ``at_least`` style range checks let NaN through on their own; this
walk rejects every non-finite float of the config at once (``kl.coef=nan``, ``trainer.lr=inf``,
``kl.target=inf``), except inside a user reward's own ``kwargs``, which only the user's function reads.
Integers must fit what numpy and torch accept (``seed`` within 0..2**32-1, every other within int64).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lab.errors import ConfigError

SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit; torch and Python take any value in this range too
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
USER_VALUES = ("kwargs",)  # a python reward's keyword arguments: passed through, not interpreted here


def _walk(node: Any, prefix: str = ""):
    """Yield ``(dotted key, value)`` for every leaf of a plain nested dict/list (lists by index)."""
    if isinstance(node, dict | list):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if str(key) not in USER_VALUES:
                yield from _walk(child, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def check_finite_and_int_ranges(cfg: Any) -> None:
    """Every float finite; ``seed`` in 0..2**32-1; every other integer within int64."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig | ListConfig) else cfg
    for key, value in _walk(plain):
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} is not a finite number")
        if isinstance(value, int) and key == "seed" and not 0 <= value <= SEED_MAX:
            raise ConfigError(f"seed={value} is out of range; must be in 0..{SEED_MAX} (2**32-1)")
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{key}={value} is out of range; must fit a 64-bit integer (|value| < 2**63)")


def check_lora(lora: Any) -> None:
    """LoRA's dropout is a probability below 1 (1 would drop every input of the adapter)."""
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout!r} is out of range; must be in [0, 1)")
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules=[] names no module; list the module names LoRA adapts")


def check_device_available(name: str) -> None:
    """``trainer.device=cuda`` (or ``cuda:N``, ``mps``) must exist on this machine."""
    import torch

    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.split(":", 1)[1]) if ":" in name and name.split(":", 1)[1].isdigit() else 0
        if count == 0:
            raise ConfigError(f"trainer.device={name!r} but no CUDA GPU is available here; use trainer.device=cpu "
                              "(or auto)")
        if index >= count:
            raise ConfigError(f"trainer.device={name!r} but this machine has {count} CUDA GPU(s): cuda:0..cuda:"
                              f"{count - 1}")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("trainer.device='mps' but MPS is not available here; use trainer.device=cpu (or auto)")


def check_numbers(cfg: Any) -> None:
    check_finite_and_int_ranges(cfg)
    check_lora(cfg.model.lora)
    check_device_available(str(cfg.trainer.device))
