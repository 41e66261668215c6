"""``rlhf-lab export RUN_OR_CHECKPOINT OUT``: a trained policy as a plain Hugging Face folder.

- ``RUN_OR_CHECKPOINT``: a run folder (its latest complete checkpoint), its ``checkpoints/`` folder or one
  ``checkpoints/step_N``.
- Full fine-tuning: the model as ``save_pretrained`` wrote it, with its tokenizer. An FSDP run's checkpoint other
  than its last holds the weights as DCP shards only: they are assembled into the run's model in this process.
- LoRA: merged into the base weights with peft's ``merge_and_unload`` (default; the base is rebuilt from the
  run's config), or ``--adapter --base MODEL_ID_OR_PATH``: the adapter kept, its ``base_model_name_or_path`` set
  to the id or path given (the run's own base may be a local cache folder).
- ``README.md``: a model card from the run's config and ``summary.json``.
- ``--push-to-hub REPO`` uploads the folder with ``huggingface_hub`` (``--private`` for a private repo).

An ``OUT`` that exists and is not empty is refused without ``--force``. Mistakes are one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rlhf_lab.app.help_text import plain
from rlhf_lab.errors import CheckpointError, ToolError, UserError

CARD_KEYS = ("algorithm.name", "algorithm.advantage", "algorithm.policy_loss", "algorithm.group_size", "kl.name",
             "kl.placement", "kl.coef", "reward.name", "model.name", "model.name_or_path", "model.lora.enabled",
             "data.name", "trainer.steps", "trainer.lr", "trainer.prompts_per_step", "trainer.max_new_tokens", "seed")
SUMMARY_KEYS = ("reward/first_20pct_mean", "reward/last_20pct_mean", "eval/reward/mean", "before/eval/reward/mean",
                "eval/kl/exact", "kl/exact_final", "steps")


def find_checkpoint(path: Path) -> Path:
    """The checkpoint folder ``path`` names (a run, its ``checkpoints/`` or a ``step_N``); one line if none."""
    from rlhf_lab.training.checkpoint import MODEL_FOLDER, STATE_FILE, locate_checkpoint
    from rlhf_lab.training.verify import damage

    path = Path(path).expanduser()
    if not path.exists():
        raise ToolError(f"{str(path)!r} does not exist; give a run folder, its checkpoints/ or a checkpoints/step_N")
    found = locate_checkpoint(path, repr(str(path)))
    if found is not None:
        problem = damage(found, STATE_FILE)
        if problem is not None:
            raise CheckpointError(f"checkpoint {found} is damaged ({problem}); use another checkpoint of the run "
                                  "(checkpoints/step_N)")
        return found
    if (path / MODEL_FOLDER).is_dir() or (path / "config.json").is_file():
        raise ToolError(f"{str(path)!r} is not a checkpoint of a run (no trainer_state.json); a model folder is "
                        "already exportable as it is")
    raise ToolError(f"{str(path)!r} holds no checkpoint with a model; give a run folder, its checkpoints/ or a "
                    "checkpoints/step_N (runs write one at the end and every trainer.checkpoint_every steps)")


def run_config(checkpoint: Path) -> dict[str, Any]:
    """The resolved config of the run that wrote ``checkpoint``: its own ``config.json``, else the run's .hydra."""
    from omegaconf import OmegaConf

    own = checkpoint / "config.json"
    if own.is_file():
        return json.loads(own.read_text(encoding="utf-8"))
    hydra = checkpoint.parent.parent / ".hydra" / "config.yaml"
    if hydra.is_file():
        return OmegaConf.to_container(OmegaConf.load(hydra), resolve=False)  # type: ignore[return-value]
    return {}


def _select(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def model_card(config: dict[str, Any], summary: dict[str, Any], checkpoint: Path, adapter_base: str | None) -> str:
    """README.md: front matter for the Hub, what was trained and how, and the run's results."""
    algorithm = _select(config, "algorithm.name") or "rl"
    lines = ["---", "library_name: " + ("peft" if adapter_base else "transformers"),
             "tags: [rlhf_lab, rlhf, " + str(algorithm) + "]"]
    base = adapter_base or _select(config, "model.name_or_path")
    if base:
        lines.append(f"base_model: {base}")
    from rlhf_lab.training.checkpoint import updates_held

    updates = updates_held(checkpoint)
    lines += ["---", "", f"# Policy trained with rlhf_lab ({algorithm})", "",
              f"Exported from `{checkpoint}` (step {updates}: the policy after {updates} updates).", ""]
    if adapter_base:
        lines += [f"A LoRA adapter over `{adapter_base}`: load it with `peft.AutoPeftModelForCausalLM.from_pretrained`.",
                  ""]
    lines += ["## Training configuration", "", "| key | value |", "| --- | --- |"]
    lines += [f"| `{key}` | {_select(config, key)} |" for key in CARD_KEYS if _select(config, key) is not None]
    shown = [(key, summary[key]) for key in SUMMARY_KEYS if key in summary]
    if shown:
        lines += ["", "## Results (summary.json)", ""]
        if summary.get("steps") not in (None, updates):  # an earlier checkpoint than the run's last
            lines += [f"The run's results at its end, step {summary['steps']}; this policy is from step {updates}.", ""]
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| `{key}` | {value:.4g} |" if isinstance(value, float) else f"| `{key}` | {value} |"
                  for key, value in shown]
    return "\n".join(lines) + "\n"


def _merge(config: dict[str, Any], model_dir: Path) -> Any:
    """The LoRA adapter in ``model_dir`` merged into the base model the run trained (rebuilt from its config)."""
    from omegaconf import OmegaConf
    from peft import PeftModel

    from rlhf_lab.models.loading import load_causal_lm, load_tokenizer, peft_wrapping

    if not config.get("model"):
        raise ToolError(f"cannot merge the adapter in {model_dir}: the run's config (to rebuild its base model) is "
                        "missing; keep it as an adapter: --adapter --base MODEL_ID_OR_PATH")
    model_cfg = OmegaConf.create(config["model"])
    tokenizer = load_tokenizer(model_cfg)
    base = load_causal_lm(model_cfg, tokenizer, "float32", int(config.get("seed", 0)))
    with peft_wrapping():
        adapted = PeftModel.from_pretrained(base, str(model_dir))
    return adapted.merge_and_unload()


def export(source: Path, out: Path, adapter: bool = False, base: str | None = None, force: bool = False) -> Path:
    """Write the policy of ``source`` to ``out`` (see the module docstring); returns the checkpoint used."""
    out = Path(out).expanduser()
    if out.is_symlink():  # --force would write through it, into a folder the command never named
        raise ToolError(f"{str(out)!r} is a symbolic link (to {os.readlink(out)!r}); give the folder itself")
    if out.is_dir() and force:
        linked = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_symlink())
        if linked:
            raise ToolError(f"{str(out)!r} holds symbolic links ({', '.join(linked[:3])}); --force writes only into "
                            "regular files: remove them or choose another folder")
    if out.exists() and not out.is_dir():
        raise ToolError(f"{str(out)!r} is a file; give a folder to export into")
    if out.exists() and any(out.iterdir()) and not force:
        raise ToolError(f"{str(out)!r} exists and is not empty; choose another folder or pass --force to write into it")
    checkpoint = find_checkpoint(source)
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise ToolError(f"{str(out)!r} is inside the checkpoint it exports ({checkpoint}); choose a folder outside it")
    config = run_config(checkpoint)
    with tempfile.TemporaryDirectory(prefix="rlhf_lab_export_") as scratch:
        model_dir = policy_folder(checkpoint, config, Path(scratch))
        _export(checkpoint, model_dir, config, out, adapter, base)
    return checkpoint


def policy_folder(checkpoint: Path, config: dict[str, Any], scratch: Path) -> Path:
    """The checkpoint's policy as a ``save_pretrained`` folder: its ``model/``, or, for an FSDP run's checkpoint that
    holds shards only, one assembled from them in ``scratch``."""
    from rlhf_lab.training.checkpoint import MODEL_FOLDER, SHARDED_FOLDER
    from rlhf_lab.training.checkpoint_sharded import export_sharded

    if (checkpoint / MODEL_FOLDER).is_dir() or not (checkpoint / SHARDED_FOLDER).is_dir():
        return checkpoint / MODEL_FOLDER
    if not config.get("model"):
        raise ToolError(f"cannot assemble the policy from the shards of {checkpoint}: the run's config (to rebuild "
                        "its model) is missing")
    return export_sharded(checkpoint, config, scratch / MODEL_FOLDER)


def _export(checkpoint: Path, model_dir: Path, config: dict[str, Any], out: Path, adapter: bool,
            base: str | None) -> None:
    from transformers import AutoTokenizer

    is_adapter = (model_dir / "adapter_config.json").is_file()
    if (adapter or base) and not is_adapter:
        raise ToolError(f"--adapter/--base keep a LoRA adapter; {checkpoint} holds a fully fine-tuned model "
                        "(exported as it is without them)")
    if adapter and not base:
        recorded = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise ToolError(f"--adapter needs --base MODEL_ID_OR_PATH, the model the adapter applies to (recorded: "
                        f"{recorded!r}, which may be a local cache folder)")
    out.mkdir(parents=True, exist_ok=True)
    if not is_adapter:
        for item in model_dir.iterdir():
            if item.is_file():
                shutil.copy2(item, out / item.name)
    elif adapter:
        for item in model_dir.iterdir():
            if item.is_file():
                shutil.copy2(item, out / item.name)
        adapter_config = json.loads((out / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = base
        (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    else:
        _merge(config, model_dir).save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(out)
    summary_file = checkpoint.parent.parent / "summary.json"
    summary = read_summary(summary_file)
    (out / "README.md").write_text(model_card(config, summary, checkpoint, base if adapter else None),
                                   encoding="utf-8")


def read_summary(path: Path) -> dict[str, Any]:
    """A run's ``summary.json`` for the model card; {} when there is none (a run still going), one line when torn."""
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ToolError(f"{str(path)!r} is not valid JSON (torn or edited); remove it to export without it") from None
    if not isinstance(summary, dict):
        raise ToolError(f"{str(path)!r} is not a JSON object; remove it to export without it")
    return summary


def push_to_hub(folder: Path, repo: str, private: bool = False) -> str:
    """Upload ``folder`` to the Hub repo ``repo`` (created if needed); returns the commit URL or id."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="Upload policy from rlhf_lab")
    except Exception as error:  # no token, no network, a bad repo name: one line
        first = str(error).splitlines()[0] if str(error) else ""
        raise ToolError(f"--push-to-hub {repo}: {type(error).__name__}: {first}") from None
    return str(getattr(commit, "commit_url", commit))


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-lab export", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("source", type=Path, help="a run folder, its checkpoints/ folder or a checkpoints/step_N")
    parser.add_argument("out", type=Path, help="the folder to write (save_pretrained layout, tokenizer, README.md)")
    parser.add_argument("--adapter", action="store_true", help="LoRA: keep the adapter instead of merging it")
    parser.add_argument("--base", default=None, help="with --adapter: the base model's hub id or path")
    parser.add_argument("--force", action="store_true", help="write into an existing, non-empty OUT")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None, help="upload OUT to this Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    options = parser.parse_args(args)
    try:
        checkpoint = export(options.source, options.out, options.adapter, options.base, options.force)
        print(f"exported {checkpoint} to {options.out}")
        if options.push_to_hub:
            print(f"pushed to {options.push_to_hub}: {push_to_hub(options.out, options.push_to_hub, options.private)}")
    except UserError as error:  # a bad argument, a damaged checkpoint
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
