"""The whole RLHF pipeline, offline on the embedded parts: ``rlhf-lab pipeline OUT [...]``.

Stages, each an ordinary run (its own folder under OUT, with ``.hydra/config.yaml``, metrics, checkpoints and
``summary.json``):

1. ``preferences``: pairs built from the embedded prompts by the gold reward (``data=embedded_preferences``);
2. ``reward_model``: a Bradley–Terry reward model on those pairs (``algorithm=reward_model``);
3. one folder per RL arm (``grpo``, ``ppo`` by default): trained against the learned reward
   (``reward=reward_model reward.model_path=OUT/reward_model/model``);
4. ``dpo``: DPO on the same pairs;
5. ``gold_eval/<arm>``: every arm's final policy, and the initial one (``initial``), evaluated on the same
   held-out prompts with the GOLD reward and the exact KL against the same initial model.

``OUT/pipeline.md`` / ``pipeline.json`` tabulate gold reward, exact KL and length per arm beside the proxy
(learned) reward the RL arms optimised: where proxy rises while gold flattens, the policy over-optimises
the reward model (Gao et al. 2022).

Overrides: ``KEY=VALUE`` applies to every stage; ``STAGE:KEY=VALUE`` to one (``build``, ``rm``, ``dpo``,
``gold``, or an RL arm's name), e.g. ``model=tiny rm:trainer.steps=40 grpo:trainer.steps=20``.
``--gold '{name: sentiment}'`` sets the gold reward (a reward config, or a reward's name; VADER by default),
``--arms grpo,ppo`` the RL arms. Every stage's config is composed and validated before the first stage runs, so a
mistake in an override, ``--gold``, ``--arms`` or OUT is one line (exit status 2) at once.

Equal wall-clock budgets: ``trainer.max_train_seconds=600 trainer.steps=100000`` gives every training stage
(reward model, each RL arm, DPO) 600 s of training steps; each stops after the step that reaches it
(``stopped_by`` in its ``summary.json``; the table's ``steps`` column shows how many each got), and the large
``trainer.steps`` makes time, not steps, the limit. Evaluation and checkpoints do not count towards it. The
LR schedule still runs over ``trainer.steps``, so keep ``trainer.lr_schedule=constant`` (the default) or a
decay barely starts. Give a stage its own limit with its prefix, e.g. ``rm:trainer.steps=40
rm:trainer.max_train_seconds=null``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from rlhf_lab.app.help_text import plain
from rlhf_lab.errors import ToolError, UserError

STAGE_PREFIXES = ("build", "rm", "dpo", "gold")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage plus the message over two lines
        raise ToolError(message)


def reward_overrides(gold: dict[str, Any]) -> list[str]:
    """``reward=NAME`` plus ``reward.KEY=VALUE`` for a reward config dict."""
    return [f"reward={gold['name']}", *(f"reward.{k}={json.dumps(v)}" for k, v in gold.items() if k != "name")]


def split_overrides(overrides: list[str], stages: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(overrides of every stage, ``STAGE:KEY=VALUE`` overrides by stage); an unknown STAGE is a ToolError."""
    common, per_stage = [], {stage: [] for stage in stages}
    for override in overrides:
        head, sep, rest = override.partition(":")
        if not sep or "=" in head:
            common.append(override)
        elif head in per_stage:
            per_stage[head].append(rest)
        else:
            raise ToolError(f"{override}: {head!r} is not a stage; prefix an override with one of: "
                            f"{', '.join(stages)}")
    return common, per_stage


def check_out(out: Path) -> None:
    """OUT must be a folder, or not exist yet (it is made)."""
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        where = "is" if existing == out else f"is inside {str(existing)!r},"
        raise ToolError(f"OUT {str(out)!r} {where} a file; give a folder for the stages' runs")


def rl_arms(text: str) -> list[str]:
    """The ``--arms`` list: online algorithms (the offline stages have their own places in the pipeline)."""
    from rlhf_lab.config.compose import group_options
    from rlhf_lab.registry import get, names

    valid = [name for name in group_options("algorithm") if name in names("algorithm")
             and not getattr(get("algorithm", name), "offline", False)]
    arms = [arm.strip() for arm in text.split(",") if arm.strip()]
    for arm in arms:
        if arm not in valid:
            raise ToolError(f"--arms {text}: {arm!r} is not an RL algorithm; choose from: {', '.join(valid)}")
        if arms.count(arm) > 1:
            raise ToolError(f"--arms {text} names {arm} twice; name each arm once")
    return arms


def gold_reward(text: str) -> dict[str, Any]:
    """The ``--gold`` reward config: a YAML mapping with a ``name``, or just a reward's name."""
    from rlhf_lab.config.compose import group_options

    example = "e.g. --gold '{name: sentiment}'"
    try:
        gold = yaml.safe_load(text)
    except yaml.YAMLError as error:
        problem = str(getattr(error, "problem", None) or type(error).__name__)
        raise ToolError(f"--gold {text!r} is not YAML ({problem}); give a reward config, {example}") from None
    if isinstance(gold, str):
        gold = {"name": gold}
    if not isinstance(gold, dict) or not isinstance(gold.get("name"), str):
        raise ToolError(f"--gold {text!r} is not a reward config; give a mapping with a reward's name, {example}")
    rewards = group_options("reward")
    if gold["name"] not in rewards:
        raise ToolError(f"--gold {text!r}: reward {gold['name']!r} is not an option; choose from: {', '.join(rewards)}")
    return gold


def check_stages(stages: dict[str, tuple[list[str], Path]], pending: list[str]) -> None:
    """Compose and validate every stage's config (as the CLI does a run's) before the first one runs."""
    from rlhf_lab.config import compose

    for name, (overrides, folder) in stages.items():
        try:
            compose([*overrides, f"trainer.output_dir={folder}"], pending_paths=pending)
        except UserError as error:
            raise ToolError(f"pipeline stage {name}: {error}") from None


def run_stage(overrides: list[str], folder: Path) -> dict[str, Any]:
    """Compose and validate as the CLI does, write ``.hydra/config.yaml``, run; the stage's summary."""
    from rlhf_lab.config import compose
    from rlhf_lab.training.launch import run

    cfg = stage_identity(compose([*overrides, f"trainer.output_dir={folder}"]), folder)
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    print(f"== {folder.name}: {' '.join(overrides)}", flush=True)
    return run(cfg, folder)


def stage_identity(cfg: Any, folder: Path) -> Any:
    """A stage's W&B identity, unless the user set it: job type ``pipeline/<stage folder>``, and one group for the
    whole pipeline (``pipeline-<OUT's name>``), so its stages sit together on the dashboard."""
    logger = cfg.logger
    if "job_type" in logger and logger.job_type is None:
        logger.job_type = f"pipeline/{folder.name}"
    if "group" in logger and logger.group is None:
        logger.group = f"pipeline-{folder.resolve().parent.name}"
    return cfg


def load_final_policy(trainer: Any, run_folder: Path) -> None:
    """Load a run's last checkpoint's policy weights (full weights or LoRA adapter) into ``trainer``'s policy."""
    from rlhf_lab.errors import CheckpointError
    from rlhf_lab.runtime import distributed
    from rlhf_lab.training.checkpoint import latest_checkpoint, load_policy_weights

    folder = latest_checkpoint(run_folder / "checkpoints")
    if folder is None:
        raise CheckpointError(f"{run_folder} holds no complete checkpoint to evaluate")
    load_policy_weights(folder, distributed.unwrap(trainer.policy), trainer.models.uses_adapter)


def gold_evaluate(overrides: list[str], arm_folder: Path | None, folder: Path) -> dict[str, Any]:
    """Evaluate an arm's final policy (``None``: the initial model) with the online trainer's yardstick."""
    from rlhf_lab.config import compose
    from rlhf_lab.training.loop import Trainer

    cfg = stage_identity(compose([*overrides, f"trainer.output_dir={folder}"]), folder)
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    # The evaluated policy is recorded with the config, so `rlhf-lab report OUT/gold_eval` tells the arms apart.
    recorded = OmegaConf.to_container(cfg, resolve=True)
    recorded["policy"] = arm_folder.name if arm_folder is not None else "initial"
    OmegaConf.save(OmegaConf.create(recorded), folder / ".hydra" / "config.yaml")
    trainer = Trainer(cfg, folder)
    try:
        if arm_folder is not None:
            load_final_policy(trainer, arm_folder)
        metrics = trainer.evaluate(cfg.trainer.steps)
        trainer.records.log({"step": cfg.trainer.steps, **metrics}, cfg.trainer.steps)
        trainer.records.finish(metrics)
    finally:
        trainer.records.close()
    return metrics


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    columns = ["arm", "gold eval reward", "eval KL exact", "eval length", "proxy eval reward", "steps", "s/step"]
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline; a user's mistake is one ``error:`` line and exit status 2."""
    try:
        return run_pipeline(argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_pipeline(argv: list[str] | None = None) -> dict[str, Any]:
    import rlhf_lab.components  # noqa: F401  (registers every part)

    parser = _Parser(prog="rlhf-lab pipeline", description=plain(__doc__.split("\n")[0]))
    parser.add_argument("out", type=Path, help="folder for every stage's run")
    parser.add_argument("--arms", default="grpo,ppo", help="RL algorithms trained against the learned reward")
    parser.add_argument("--gold", default="{name: sentiment}",
                        help="the gold reward: a reward config (YAML mapping) or a reward's name")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE (every stage) or STAGE:KEY=VALUE")
    args = parser.parse_intermixed_args(argv)
    out = args.out.expanduser().resolve()
    check_out(out)
    arms = rl_arms(args.arms)
    gold = gold_reward(args.gold)
    common, stage = split_overrides(args.overrides, [*STAGE_PREFIXES, *arms])
    pairs = out / "preferences"
    reward_model = out / "reward_model" / "model"
    build_data = ["data=embedded_preferences", f"data.path={pairs}"]
    pair_data = ["data=preferences", f"data.path={pairs}", "data.margin_column=margin"]
    proxy = ["reward=reward_model", f"reward.model_path={reward_model}"]
    stages = {
        "build": ([*common, "algorithm=dpo", *build_data, *stage["build"]], pairs),
        "rm": ([*common, "algorithm=reward_model", *pair_data, *stage["rm"]], out / "reward_model"),
        **{arm: ([*common, f"algorithm={arm}", *proxy, *stage[arm]], out / arm) for arm in arms},
        "dpo": ([*common, "algorithm=dpo", *pair_data, *reward_overrides(gold), *stage["dpo"]], out / "dpo"),
        "gold": ([*common, "algorithm=grpo", *reward_overrides(gold), *stage["gold"]], out / "gold_eval" / "initial"),
    }
    check_stages(stages, pending=[str(reward_model)])

    from rlhf_lab.config import compose
    from rlhf_lab.offline.builder import ensure_preferences

    build_cfg = compose(stages["build"][0])
    build_cfg.data.gold = gold
    ensure_preferences(build_cfg)
    summaries: dict[str, dict[str, Any]] = {}
    summaries["reward_model"] = run_stage(*stages["rm"])
    for arm in arms:
        summaries[arm] = run_stage(*stages[arm])
    summaries["dpo"] = run_stage(*stages["dpo"])

    evaluation = stages["gold"][0]
    rows = []
    for arm in ["initial", *arms, "dpo"]:
        metrics = gold_evaluate(evaluation, None if arm == "initial" else out / arm, out / "gold_eval" / arm)
        summary = summaries.get(arm, {})
        rows.append({"arm": arm, "gold eval reward": metrics.get("eval/reward/mean"),
                     "eval KL exact": metrics.get("eval/kl/exact"),
                     "eval length": metrics.get("eval/response/length_mean"),
                     "proxy eval reward": summary.get("eval/reward/mean", "") if arm in arms else "",
                     "steps": summary.get("steps", ""), "s/step": summary.get("time/step_s_median", "")})
    rm = summaries["reward_model"]
    result = {"arms": rows, "reward_model": {k: v for k, v in rm.items() if k.startswith(("eval/", "before/eval/"))},
              "preferences": json.loads((pairs / "recipe.json").read_text(encoding="utf-8"))["counts"]}
    report = (f"# RLHF pipeline: {out}\n\nGold reward: `{gold}`; preference pairs: {result['preferences']}\n\n"
              f"Reward model held-out accuracy {rm.get('eval/accuracy', float('nan')):.3f} "
              f"(before training {rm.get('before/eval/accuracy', float('nan')):.3f}), "
              f"mean margin {rm.get('eval/margin_mean', float('nan')):.3f}\n\n{table(rows)}\n")
    (out / "pipeline.md").write_text(report, encoding="utf-8")
    (out / "pipeline.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(report)
    return result


if __name__ == "__main__":
    main()
