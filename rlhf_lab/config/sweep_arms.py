"""Arms of a sweep that are one computation: a comparison that cannot tell them apart says so at start.

A sweep over algorithms compares updates. Some arms differ in name only, given the rest of their config:

- with one on-policy update per rollout (one epoch, one mini-batch) the importance ratio is 1 at the update, so
  PPO's clip never binds, CISPO's clipped weight is 1 and GSPO's sequence ratio is 1: ``policy_loss=clip``,
  ``cispo`` and ``gspo`` are all −A·∇log π per token (their clip ranges do not matter; GSPO's gradient is the
  sequence's mean of them, which its ``sequence_mean`` aggregation gives clip too);
- ``advantage=dr_grpo`` (R − group mean) and ``rloo`` (R − mean of the others) differ by the constant factor
  G/(G − 1), which Adam's normalised update does not see, when nothing else enters the loss (a reward-placed KL,
  no entropy bonus);
- where every response has the same length (``model=exact``: no EOS) the loss aggregations ``token_mean``,
  ``sequence_mean`` and ``sequence_sum_constant`` are constant multiples of each other.

Settings that only one advantage estimator reads (a baseline, the std division) are ignored for the others. Arms
left equal after that compute the same updates: :func:`identical_arms` names them, and the command line warns.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

RUN_KEYS = ("seed", "experiment_name")  # what an arm's jobs differ in without being another computation
ONLY_FOR = {"baseline": ("reinforce",), "scale_by_std": ("grpo",), "std_eps": ("grpo",), "remax_return": ("remax",)}
CLIP_KEYS = ("clip_eps", "clip_eps_low", "clip_eps_high", "clip_ratio_c")


def single_update(cfg: Any) -> bool:
    """Whether each rollout gets exactly one optimizer step (one epoch, one mini-batch): π_old is then π_θ itself
    at the training pass, and that pass's own log-probs (detached) are π_old, with no pass of their own."""
    algorithm, samples = cfg.algorithm, cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    return algorithm.epochs == 1 and (algorithm.mini_batch_size == 0 or algorithm.mini_batch_size >= samples)


def computation(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """The parts of a job's config that decide its updates, normalised as above: (them, why some were merged)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in RUN_KEYS:
        plain.pop(key, None)
    for key in ("output_dir", "resume", "progress_bar", "library_progress_bars", "save", "keep_last_n",
                "checkpoint_every"):
        plain["trainer"].pop(key, None)
    plain.pop("logger", None)
    algorithm, why = plain["algorithm"], []
    algorithm.pop("name", None)
    advantage = algorithm.get("advantage")
    for key, readers in ONLY_FOR.items():
        if advantage not in readers:
            algorithm.pop(key, None)
    one_update = single_update(cfg) and algorithm.get("tis_cap") is None
    if one_update and algorithm.get("policy_loss") in ("clip", "cispo", "gspo"):
        if algorithm["policy_loss"] != "clip":
            why.append(f"one on-policy update per rollout: the ratio is 1, so {algorithm['policy_loss']} is clip")
        algorithm["policy_loss"] = "clip"
        for key in CLIP_KEYS:
            algorithm.pop(key, None)
    kl_in_loss = cfg.kl.placement == "loss" and cfg.kl.name != "none"
    if advantage == "dr_grpo" and not kl_in_loss and not algorithm.get("entropy_coef"):
        algorithm["advantage"] = "rloo"
        why.append("dr_grpo is rloo × (G − 1)/G, a constant Adam does not see")
    if cfg.model.name == "exact" and algorithm.get("loss_aggregation") in ("sequence_mean", "sequence_sum_constant"):
        algorithm["loss_aggregation"] = "token_mean"
        why.append("every response has the same length, so the loss aggregations differ by constants")
    return plain, why


def identical_arms(jobs: list[tuple[list[str], Any]]) -> list[str]:
    """One line per group of arms (jobs less their seed) that compute the same updates."""
    arms: dict[tuple[str, ...], Any] = {}
    shared = set.intersection(*(set(overrides) for overrides, _ in jobs)) if jobs else set()
    for overrides, cfg in jobs:  # an arm is named by what sets it apart
        arm = tuple(o for o in overrides if o not in shared and o.split("=", 1)[0].lstrip("+~") not in RUN_KEYS)
        arms.setdefault(arm, cfg)
    groups: list[tuple[dict[str, Any], list[str], list[str]]] = []
    for arm, cfg in arms.items():
        shape, why = computation(cfg)
        label = " ".join(arm) or "(no overrides)"
        for group in groups:
            if group[0] == shape:
                group[1].append(label)
                group[2].extend(reason for reason in why if reason not in group[2])
                break
        else:
            groups.append((shape, [label], list(why)))
    return [f"sweep arms {' | '.join(labels)} compute the same updates ({'; '.join(why)}): a comparison cannot "
            "tell them apart" for _, labels, why in groups if len(labels) > 1]
