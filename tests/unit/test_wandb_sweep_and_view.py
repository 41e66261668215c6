"""``rlhf-lab wandb sweep`` (a W&B sweep file from a Hydra sweep) and ``rlhf-lab wandb workspace`` (the KL-ablation
view's spec), both built offline."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_lab.config import compose
from rlhf_lab.errors import ToolError
from rlhf_lab.trackers.wandb_sweep import COMMAND, sweep_config
from rlhf_lab.trackers.wandb_workspace import GROUP_BY, SECTIONS, spec, workspace
from tests.limits import HANG_GUARD_S

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_an_experiments_grid_becomes_the_sweeps_parameters() -> None:
    config = sweep_config(["experiment=kl_ablation", "model=tiny", "seed=5"])
    assert config["method"] == "grid" and config["name"] == "kl_ablation"
    assert config["metric"] == {"name": "eval/reward/mean", "goal": "maximize"}
    assert config["parameters"]["kl"] == {"values": ["kl", "abs", "mse", "k3", "full", "none"]}
    assert config["parameters"]["kl.placement"] == {"values": ["reward", "loss"]}
    assert config["parameters"]["seed"] == {"value": 5}  # the command line's value replaces the experiment's
    assert config["parameters"]["experiment"] == {"value": "kl_ablation"}
    assert config["command"] == COMMAND and "hydra.mode=RUN" in COMMAND  # one plain run per agent run


def test_an_optuna_search_space_becomes_distributions_and_its_direction_the_goal() -> None:
    config = sweep_config(["+hparams_search=lr_kl", "model=tiny", "trainer.steps=tag(int, interval(2,5))",
                           "+kl_arm=kl_loss,abs_reward"])
    assert config["method"] == "bayes"
    assert config["metric"] == {"name": "eval/reward/mean", "goal": "maximize"}
    assert config["parameters"]["trainer.lr"] == {"distribution": "log_uniform_values", "min": 1e-6, "max": 1e-4}
    assert config["parameters"]["kl.coef"] == {"distribution": "log_uniform_values", "min": 1e-3, "max": 1.0}
    assert config["parameters"]["trainer.steps"] == {"distribution": "int_uniform", "min": 2, "max": 5}
    assert config["parameters"]["+kl_arm"] == {"values": ["kl_loss", "abs_reward"]}  # Hydra's + kept: it appends


def test_the_exact_task_ranks_by_the_gap_and_floats_are_short() -> None:
    config = sweep_config(["experiment=exact", "kl.coef=0.1,0.30000000000000004"])
    assert config["metric"] == {"name": "exact/gap", "goal": "minimize"}
    assert config["parameters"]["kl.coef"] == {"values": [0.1, 0.3]}
    assert sweep_config(["model=tiny"], metric="loss/policy")["metric"]["goal"] == "minimize"


def test_bad_sweep_requests_are_one_line() -> None:
    with pytest.raises(ToolError, match=r"--method grid cannot enumerate the intervals of kl.coef; use"):
        sweep_config(["model=tiny", "kl.coef=interval(0.01,1)"], method="grid")
    with pytest.raises(ToolError, match=r"--method 'tpe' is not valid; choose from: grid, random, bayes"):
        sweep_config(["model=tiny"], method="tpe")
    with pytest.raises(ToolError, match=r"--goal 'up' is not valid; choose from: minimize, maximize"):
        sweep_config(["model=tiny"], goal="up")


def test_what_the_agent_passes_composes_to_the_points_values() -> None:
    """W&B's agent turns a point into ``key=value`` arguments (its own code); they compose to that point."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    config = sweep_config(["model=tiny", "algorithm=grpo,rloo", "kl.coef=0.05,0.2", "+kl_arm=kl_loss"])
    point = {"algorithm": "rloo", "kl.coef": 0.2, "+kl_arm": "kl_loss", "model": "tiny"}
    assert set(point) == set(config["parameters"])
    args = create_sweep_command_args({"args": {key: {"value": value} for key, value in point.items()}})
    cfg = compose(args["args_no_hyphens"])
    assert (cfg.algorithm.advantage, cfg.kl.coef, cfg.kl.placement, cfg.model.name) == ("rloo", 0.2, "loss", "tiny")


def test_the_command_writes_the_file_and_refuses_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "sweep.yaml"
    done = subprocess.run([sys.executable, "-m", "rlhf_lab", "wandb", "sweep", "model=tiny", "seed=0,1",
                           "--out", str(out)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(out.read_text())["parameters"]["seed"] == {"values": [0, 1]}
    assert f"wrote {out} (grid, 2 runs, ranked by eval/reward/mean maximize)" in done.stdout
    done = subprocess.run([sys.executable, "-m", "rlhf_lab", "wandb", "sweeps"], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: rlhf-lab wandb takes a command, got 'sweeps'; choose from: sweep, "
                                   "workspace")


def _documented_metrics() -> set[str]:
    text = (DOCS / "reference" / "metrics.md").read_text()
    return set(re.findall(r"`([a-z_]+(?:/[a-z_]+)+)`", text))


def test_the_workspace_view_plots_logged_metrics_grouped_by_arm() -> None:
    view = spec(workspace("team", "proj", group="kl_ablation-multirun_x"))
    assert (view["entity"], view["project"]) == ("team", "proj")
    sections = view["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == ["Objective", "Reward vs KL", "KL estimate vs exact", "Clipping"]
    documented, plotted = _documented_metrics(), set()
    for section in sections:
        for panel in section["panels"]:
            config = panel["config"]
            names = config.get("metrics") or [config[axis].removeprefix("summary:") for axis in ("xAxis", "yAxis")]
            plotted.update(names)
            if panel["viewType"] == "Run History Line Plot":  # seeds of one arm: one line with a band
                assert (config["xAxis"], config["groupBy"], config["groupArea"]) == ("step", "algorithm_name.value",
                                                                                      "minmax")
    assert plotted <= documented, plotted - documented  # every panel reads a name rlhf_lab logs
    assert {"exact/gap", "kl/estimate", "kl/exact", "policy/clipped_low_frac", "reward/mean"} <= plotted
    (runset,) = view["spec"]["section"]["runSets"]
    assert [g["name"] for g in runset["grouping"]] == [f"{key}.value" for key in GROUP_BY]
    (only,) = runset["filters"]["filters"]
    assert (only["key"]["name"], only["value"]) == ("group", "kl_ablation-multirun_x")
    assert sum(len(panels) for panels in SECTIONS.values()) == sum(len(s["panels"]) for s in sections)


def test_pipeline_stages_share_a_group_and_name_their_stage(tmp_path: Path) -> None:
    from rlhf_lab.tools.pipeline import stage_identity

    cfg = stage_identity(compose(["model=tiny", "logger=wandb"]), tmp_path / "study" / "reward_model")
    assert (cfg.logger.job_type, cfg.logger.group) == ("pipeline/reward_model", "pipeline-study")
    cfg = stage_identity(compose(["model=tiny", "logger=wandb", "logger.group=mine", "logger.job_type=x"]),
                         tmp_path / "study" / "dpo")
    assert (cfg.logger.job_type, cfg.logger.group) == ("x", "mine")  # what the user set stays
    assert "job_type" not in stage_identity(compose(["model=tiny"]), tmp_path / "study" / "dpo").logger


def test_the_sweep_file_never_opens_an_optuna_study(own_folder: Path) -> None:
    """Another search's study under this folder's ``outputs/optuna/lr_kl.db`` (the README's Optuna example leaves
    one) stops a second, different search from joining it, and is no concern of a W&B sweep file."""
    import optuna

    from rlhf_lab.config.validate_sweep import SEARCH_ATTR
    from rlhf_lab.errors import ConfigError

    (own_folder / "outputs" / "optuna").mkdir(parents=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="default_lr_kl", storage="sqlite:///outputs/optuna/lr_kl.db")
    study.set_user_attr(SEARCH_ATTR, {"space": ["kl.coef"], "fixed": [], "direction": "maximize"})
    search = ["+hparams_search=lr_kl", "model=tiny"]
    with pytest.raises(ConfigError, match="holds a search with other searched keys"):
        compose(search)
    assert sweep_config(search)["parameters"]["kl.coef"]["distribution"] == "log_uniform_values"
