"""The KL options and the exact task: rules across fields, and one warning for a KL penalty that does nothing.

- ``kl.clamp_log_ratio`` and ``kl.clamp_value`` (> 0) bound the estimate wherever it is placed;
  ``kl.importance_weight`` acts on the loss-placed KL term only: with ``kl.placement=reward`` (samples of the
  policy that is scored, nothing to reweight) it is an error rather than silently ignored; so is
  ``kl.off_policy_correction=token_ratio|prefix_ratio`` (a reward-placed KL is corrected by the policy loss's
  ``algorithm.tis_mode``), and either ratio beside ``kl.importance_weight`` (the same weight twice).
- An estimator × placement whose expected gradient is zero (``kl=kl`` in the loss, ``full`` in the reward:
  ``rlhf_lab.kl.ZERO_KL_GRADIENT``) prints one warning line, once per process, naming the table entry.
- ``model=exact`` enumerates every response, so sampling must be the plain softmax (``trainer.top_p=1``,
  ``trainer.top_k=0``), the prompts the task's own (``data=exact``), and V^T small enough to enumerate;
  ``reward=exact_table`` needs ``model=exact`` and its V and T.
"""

from __future__ import annotations

import sys
from typing import Any

from rlhf_lab.config.validate_values import at_least, choice
from rlhf_lab.errors import ConfigError
from rlhf_lab.kl import zero_gradient_warning
from rlhf_lab.registry import get, names
from rlhf_lab.testbed.task import MAX_SEQUENCES

_WARNED: set[str] = set()  # warnings already printed by this process (the CLI validates before each job)


def check_kl_options(kl: Any) -> None:
    at_least("kl.clamp_log_ratio", kl.clamp_log_ratio, 0.0, strict=True)
    at_least("kl.clamp_value", kl.clamp_value, 0.0, strict=True)
    correction = kl.get("off_policy_correction", "policy")
    choice("kl.off_policy_correction", correction, names("kl_correction"))
    own_ratio = getattr(get("kl_correction", correction), "own_ratio", False)  # rlhf_lab/kl/corrections.py
    if own_ratio and kl.importance_weight:
        raise ConfigError(f"kl.off_policy_correction={correction} already weighs the estimate by pi_theta/mu; "
                          "kl.importance_weight=true would weigh it twice: drop one")
    if kl.placement == "loss":
        return
    if kl.importance_weight not in (None, False):
        raise ConfigError(f"kl.importance_weight={kl.importance_weight!r} acts on the loss-placed KL term; with "
                          f"kl.placement={kl.placement} it would do nothing: use kl.placement=loss or drop it")
    if own_ratio:
        raise ConfigError(f"kl.off_policy_correction={correction} weighs the loss-placed KL term; with "
                          f"kl.placement={kl.placement} the KL is in the return, corrected by algorithm.tis_mode: "
                          "use kl.placement=loss or drop it")


LOSS_SCALES = ("none", "advantage")  # kl.loss_scale


def check_loss_scale(cfg: Any) -> None:
    """``kl.loss_scale=advantage`` needs a loss-placed term and advantages whose factor on the task reward is
    known (``kl_loss_scale`` of the estimator), used as they are (no whitening, no weighting by the reward)."""
    kl, algorithm = cfg.kl, cfg.algorithm
    choice("kl.loss_scale", kl.loss_scale, LOSS_SCALES)
    if kl.loss_scale == "none":
        return
    if kl.placement != "loss":
        raise ConfigError(f"kl.loss_scale={kl.loss_scale} scales the loss-placed KL term; with "
                          f"kl.placement={kl.placement} the advantages already carry the penalty: drop it")
    advantage = algorithm.get("advantage")
    scaled = [name for name in names("advantage") if getattr(get("advantage", name), "kl_loss_scale", None)]
    if advantage not in scaled:
        raise ConfigError(f"kl.loss_scale=advantage needs an advantage estimator whose factor on the task reward is "
                          f"known; algorithm.advantage={advantage} has none: use one of {', '.join(sorted(scaled))}")
    if algorithm.get("whiten_advantages") or algorithm.get("weight_by", "advantage") != "advantage":
        raise ConfigError("kl.loss_scale=advantage matches the advantages as the estimator makes them; "
                          "algorithm.whiten_advantages=true or algorithm.weight_by=reward rescale them: drop one")


def warn_zero_gradient(kl: Any) -> None:
    """One line on stderr for a penalty whose expected gradient is zero (once per process and pair)."""
    message = zero_gradient_warning(kl.name, kl.placement)
    if message is not None and message not in _WARNED:
        _WARNED.add(message)
        print(message, file=sys.stderr, flush=True)


def check_exact_task(cfg: Any) -> None:
    trainer = cfg.trainer
    at_least("trainer.exact_every", trainer.exact_every, 0)
    if cfg.model.name != "exact":
        if cfg.reward.name == "exact_table":
            raise ConfigError(f"reward=exact_table scores the exact task's responses; model={cfg.model.name} does not "
                              "write them: use model=exact data=exact (experiment=exact)")
        return
    if trainer.top_p != 1.0 or trainer.top_k != 0:
        raise ConfigError(f"model=exact enumerates the policy's softmax, which trainer.top_p={trainer.top_p} / "
                          f"trainer.top_k={trainer.top_k} truncate when sampling: use top_p=1.0 and top_k=0")
    if cfg.data.name != "exact":
        raise ConfigError(f"model=exact answers its one <bos> prompt; data={cfg.data.name} does not fit: use data=exact")
    symbols, length = cfg.model.exact.symbols, trainer.max_new_tokens
    if not 2 <= symbols <= 26:
        raise ConfigError(f"model.exact.symbols={symbols} is out of range; must be in [2, 26]")
    if symbols**length > MAX_SEQUENCES:
        raise ConfigError(f"model=exact with model.exact.symbols={symbols} and trainer.max_new_tokens={length} has "
                          f"{symbols**length} responses, over the {MAX_SEQUENCES} the exact metrics can enumerate")
    if cfg.reward.name == "exact_table" and (cfg.reward.get("modes", 0) == 1
                                             or not 0 <= cfg.reward.get("modes", 0) <= cfg.reward.peaks):
        raise ConfigError(f"reward.modes={cfg.reward.modes} is out of range; must be 0 (off) or in "
                          f"[2, reward.peaks={cfg.reward.peaks}]")
    if cfg.reward.name == "exact_table" and (cfg.reward.symbols, cfg.reward.length) != (symbols, length):
        raise ConfigError(f"reward.symbols={cfg.reward.symbols} / reward.length={cfg.reward.length} must equal "
                          f"model.exact.symbols={symbols} / trainer.max_new_tokens={length}")
    stop = bool(cfg.model.exact.get("stop", False))
    if cfg.reward.name == "exact_table" and bool(cfg.reward.get("stop", False)) != stop:
        raise ConfigError(f"reward.stop={cfg.reward.get('stop', False)} must equal model.exact.stop={stop} (whether a "
                          "response ends at the last symbol)")
    env = (cfg.get("env") or {}).get("name", "single_turn")
    if stop and env != "single_turn":
        raise ConfigError(f"model.exact.stop=true with env={env}: the environment enumerates turns of exactly "
                          "trainer.max_new_tokens symbols; use model.exact.stop=false")


def check_kl(cfg: Any) -> None:
    """The KL options' cross-field rules, the zero-gradient warning, and the exact task's requirements."""
    check_kl_options(cfg.kl)
    check_loss_scale(cfg)
    check_exact_task(cfg)
    warn_zero_gradient(cfg.kl)
