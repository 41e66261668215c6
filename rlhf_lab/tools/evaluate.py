"""``rlhf-lab eval RUN_OR_CHECKPOINT_OR_MODEL [overrides] [--out DIR]``: evaluate a policy on held-out prompts.

The source is a run folder (its latest checkpoint), a ``checkpoints/step_N``, a model folder or a hub id. A run
is re-composed from its ``.hydra/overrides.yaml`` plus the overrides given here; a model is evaluated as
``model=path model.name_or_path=SOURCE``. The code is training's evaluation (:mod:`rlhf_lab.training.evaluation`),
with its own settings: ``eval.prompts``, ``eval.samples_per_prompt``, ``eval.temperature``, ``eval.top_p``,
``eval.greedy``, eval-only rewards (``eval.rewards=[length]``), the win rate against the reference policy
(``eval.win_rate=true``, ``eval.win_rate_reward=NAME``) and the exact KL to the reference.

Writes ``eval.json`` (metrics, source, settings) and ``eval_samples.jsonl`` into ``--out`` (default: the run's
``eval/<time>/``, or ``outputs/eval/<time>/`` for a model) and logs to the configured trackers (``logger=...``).
It holds the lock of the run folder it writes into (:mod:`rlhf_lab.training.run_lock`; ``--out`` itself when no
run folder holds it), so it never writes into a run that is still training.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rlhf_lab.app.help_text import plain
from rlhf_lab.errors import ToolError, UserError

DROPPED = ("trainer.resume=", "trainer.output_dir=", "hydra.", "+hydra.")


def source_overrides(source: str) -> tuple[list[str], Path | None, Path | None]:
    """(overrides that rebuild the source's config, its checkpoint or None, its run folder or None)."""
    from rlhf_lab.tools.export import find_checkpoint
    from rlhf_lab.training.checkpoint import STEP_FOLDER

    path = Path(source).expanduser()
    if not path.exists():
        looks_like_hub_id = source.count("/") == 1 and not source.startswith((".", "/", "~"))
        if looks_like_hub_id:
            return ["model=path", f"model.name_or_path={source}"], None, None
        raise ToolError(f"{source!r} does not exist; give a run folder, a checkpoints/step_N, a model folder or a "
                        "hub id (org/name)")
    is_run = STEP_FOLDER.match(path.name) or (path / "checkpoints").is_dir() or path.name == "checkpoints"
    if not is_run and (path / "config.json").is_file():  # a save_pretrained model folder
        return ["model=path", f"model.name_or_path={path.resolve()}"], None, None
    checkpoint = find_checkpoint(path)
    run_dir = checkpoint.parent.parent
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        raise ToolError(f"{str(run_dir)!r} has no .hydra/overrides.yaml to rebuild its config; evaluate its "
                        f"model folder instead: {checkpoint / 'model'} (full fine-tuning) or export it first")
    try:
        stored = yaml.safe_load(overrides_file.read_text(encoding="utf-8")) or []
    except (yaml.YAMLError, UnicodeDecodeError):
        stored = None
    if not isinstance(stored, list):
        raise ToolError(f"{str(overrides_file)!r} is not a YAML list of overrides (torn or edited); evaluate "
                        f"{checkpoint / 'model'} as a model folder instead")
    lines = [str(line) for line in stored]
    return [line for line in lines if not line.startswith(DROPPED)], checkpoint, run_dir


def names_code(line: str) -> bool:
    """Whether an override names code to import: a plug-in module, or a function (a python reward, a judge, a
    composite's or eval reward's component)."""
    key, _, value = line.partition("=")
    key = key.lstrip("+~")
    return key == "plugins" or key.endswith((".function", ".judge")) or "function:" in value or "judge:" in value


def check_stored_code(stored: list[str], given: list[str], where: Path) -> None:
    """A run folder is data: code its stored config names (``reward.function=...``, ``plugins=[...]``) is imported
    only when the user names it again on the command line (``--trust-run-config`` trusts the folder)."""
    given_keys = {line.split("=", 1)[0].lstrip("+~") for line in given}
    for line in stored:
        key = line.split("=", 1)[0].lstrip("+~")
        if names_code(line) and key not in given_keys:
            raise ToolError(f"{str(where)!r} names code to run ({line}); a run folder is data, so its code runs only "
                            f"when you name it: give {key}=... on the command line, or pass --trust-run-config")


def load_weights(policy: Any, model_dir: Path) -> None:
    """The checkpoint's weights into the freshly built policy (its adapter, or the whole network)."""
    from safetensors.torch import load_file

    adapter = model_dir / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, load_file(str(adapter)))
        return
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(str(model_dir))
    policy.load_state_dict(trained.state_dict(), strict=False)


def lock_folder(out: Path, run_dir: Path | None) -> Path:
    """The folder whose lock an evaluation writing into ``out`` holds: the run folder ``out`` lies in (the
    source run's, or another one's), else ``out`` itself."""
    if run_dir is not None and Path(out).resolve().is_relative_to(Path(run_dir).resolve()):
        return Path(run_dir)
    from rlhf_lab.training.run_lock import enclosing_run_folder

    return enclosing_run_folder(out) or Path(out)


def evaluate_source(source: str, overrides: list[str], out: Path | None = None,
                    trust_run_config: bool = False) -> dict[str, Any]:
    """Compose, load, evaluate; returns what ``eval.json`` holds. Code named only by the source's stored config is
    refused unless ``trust_run_config`` (:func:`check_stored_code`)."""
    import rlhf_lab.components  # noqa: F401  (registers the built-in parts)
    from rlhf_lab.config.compose import compose
    from rlhf_lab.training import run_lock

    base, checkpoint, run_dir = source_overrides(source)
    if run_dir is not None and not trust_run_config:
        check_stored_code(base, overrides, run_dir / ".hydra" / "overrides.yaml")
    cfg = compose([*base, *overrides])
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(out) if out is not None else (run_dir / "eval" / stamp if run_dir else Path("outputs") / "eval" / stamp)
    if out.exists() and not out.is_dir():
        raise ToolError(f"--out {str(out)!r} is a file; give a folder for eval.json")
    locked = lock_folder(out, run_dir)
    run_lock.acquire(locked, instead="give --out a folder outside it")
    try:
        from rlhf_lab.runtime.console import library_progress_bars

        with library_progress_bars(cfg.trainer.library_progress_bars):  # as in training: off by default
            return _evaluate(cfg, base, overrides, source, checkpoint, run_dir, out)
    finally:
        run_lock.release(locked)


def _evaluate(cfg: Any, base: list[str], overrides: list[str], source: str, checkpoint: Path | None,
              run_dir: Path | None, out: Path) -> dict[str, Any]:
    """Load the policy (the checkpoint's weights), evaluate it, write ``eval.json`` and the samples into ``out``."""
    from omegaconf import OmegaConf

    from rlhf_lab.data.prompts import load_prompts
    from rlhf_lab.kl.placements import KLPenalty
    from rlhf_lab.models.loading import build_policy, load_tokenizer
    from rlhf_lab.rewards.base import build_reward
    from rlhf_lab.runtime.files import write_json_atomic
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.step.experience import ExperienceMaker
    from rlhf_lab.trackers.jsonl import JsonlWriter
    from rlhf_lab.trackers.multi import build_tracker
    from rlhf_lab.training.checkpoint import updates_held
    from rlhf_lab.training.evaluation import Evaluation
    from rlhf_lab.training.setup import resolve_device, seed_everything

    device = resolve_device(cfg.trainer.device)
    precision = Precision.from_config(cfg.trainer, device, warn=False)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    models = build_policy(cfg.model, tokenizer, precision.weights_dtype, cfg.seed)
    if checkpoint is not None:  # an FSDP run's checkpoint may hold shards only: assembled first
        from rlhf_lab.tools.export import policy_folder, run_config

        with tempfile.TemporaryDirectory(prefix="rlhf_lab_eval_") as scratch:
            load_weights(models.policy, policy_folder(checkpoint, run_config(checkpoint), Path(scratch)))
    policy = models.policy.to(device).eval()
    if models.reference is not None:
        models.reference.to(device)
    reward = build_reward(cfg.reward, device=str(device))
    kl = KLPenalty(cfg.kl)

    def make_maker(maker_cfg: Any, network: Any, worker: Any = None) -> ExperienceMaker:
        return ExperienceMaker(maker_cfg, tokenizer, models, network, reward, kl, device, precision, worker=worker)

    evaluation = Evaluation.from_parts(cfg, make_maker(cfg, policy), make_maker, models,
                                       lambda reward_cfg: build_reward(reward_cfg, device=str(device)))
    prompts = load_prompts(cfg.data, seed=cfg.seed).eval[: evaluation.settings.prompts]
    if not prompts:
        raise ToolError("no evaluation prompts: set eval.prompts (or trainer.eval_prompts) above 0, or give a data "
                        "set with an eval split")
    step = updates_held(checkpoint) if checkpoint is not None else 0  # training's evaluation of it had this step
    metrics, examples = evaluation.run(prompts, step, cfg.seed, float(cfg.kl.coef))
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": step, "prompt": p, "response": r, "reward": score} for p, r, score in examples]
    writer = JsonlWriter(out / "eval_samples.jsonl")
    for row in rows:
        writer.write(row)
    writer.close()
    result = {"source": str(source), "checkpoint": str(checkpoint) if checkpoint else None, "step": step,
              "overrides": [*base, *overrides], "settings": OmegaConf.to_container(cfg.eval, resolve=True),
              "metrics": metrics}
    write_json_atomic(out / "eval.json", result)
    tracker = build_tracker(cfg.logger, {**OmegaConf.to_container(cfg, resolve=True),
                                         "evaluates": evaluated_run(run_dir, checkpoint, step)}, out)
    tracker.log({"step": step, **metrics}, step)
    tracker.log_eval_samples(rows[: cfg.trainer.samples_per_step_logged], step)
    tracker.finish(metrics)
    result["out"] = str(out)
    return result


def evaluated_run(run_dir: Path | None, checkpoint: Path | None, step: int) -> dict[str, Any]:
    """What an evaluation's tracker run says it evaluates: the run folder, checkpoint and step, and the training
    run's W&B identity (id, project, group, name) so the evaluation joins its group on the dashboard."""
    from rlhf_lab.trackers.wandb_run import stored_run

    if run_dir is None:
        return {"checkpoint": str(checkpoint) if checkpoint else None, "step": step}
    stored = stored_run(run_dir)
    return {"run_dir": str(run_dir.resolve()), "checkpoint": str(checkpoint) if checkpoint else None, "step": step,
            "wandb_run_id": stored.get("id"), **{key: stored.get(key) for key in ("project", "entity", "group",
                                                                                  "name")}}


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-lab eval", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("source", help="a run folder, a checkpoints/step_N, a model folder or a hub id")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. eval.samples_per_prompt=4 eval.greedy=true")
    parser.add_argument("--out", type=Path, default=None, help="where to write eval.json (default: RUN/eval/<time>)")
    parser.add_argument("--trust-run-config", action="store_true",
                        help="import the code the run's stored config names (python rewards, plug-ins) without "
                             "naming it again")
    options = parser.parse_args(args)
    try:
        result = evaluate_source(options.source, options.overrides, options.out, options.trust_run_config)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    for key, value in result["metrics"].items():
        print(f"{key:32s} {value:.4f}" if isinstance(value, float) else f"{key:32s} {value}")
    print(f"wrote {Path(result['out']) / 'eval.json'}")
