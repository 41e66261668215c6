"""W&B tracker (rlhf_lab/trackers/wandb.py): mode resolution, names, and the failure paths.

Runs are in-process trainer runs of the smoke experiment's tiny settings (``model=tiny``, 2 steps, one
torch thread), W&B offline or failing on purpose; nothing contacts a server. Every W&B folder and
credential lookup points under a temporary folder.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from test_sweeps import read_metrics, read_offline_run, wandb_test_env

from rlhf_lab.trackers.wandb import (
    WandbTracker,
    WandbUnavailableWarning,
    dashboard_config,
    has_api_key,
    resolve_mode,
    run_identity,
)

TINY = ["+experiment=smoke", "logger=wandb", "trainer.eval_prompts=0", "trainer.device=cpu"]


@pytest.fixture(scope="module", autouse=True)
def _isolated_wandb(tmp_path_factory):
    """Offline, no credentials, every W&B folder in a temporary folder (for the whole module)."""
    from hydra.core.hydra_config import HydraConfig

    root = tmp_path_factory.mktemp("wandb_env")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HydraConfig.instance(), "cfg", None)  # no Hydra job left over from another test
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            patch.delenv(key)
        for key, value in wandb_test_env(root).items():
            patch.setenv(key, value)
        threads = torch.get_num_threads()
        yield
        torch.set_num_threads(threads)


def train(run_dir: Path, *overrides: str) -> tuple[dict, list[warnings.WarningMessage]]:
    """Train the tiny smoke setup in-process; return the summary and the W&B warnings raised."""
    from rlhf_lab.config import compose
    from rlhf_lab.training.loop import Trainer

    cfg = compose([*TINY, *overrides])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = Trainer(cfg, run_dir).train()
    return summary, [w for w in caught if issubclass(w.category, WandbUnavailableWarning)]


def assert_complete_locally(run_dir: Path) -> None:
    assert [line["step"] for line in read_metrics(run_dir)] == [0, 1]
    assert all("reward/mean" in line and "kl/exact" in line for line in read_metrics(run_dir))
    assert (run_dir / "samples.jsonl").stat().st_size > 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


# ------------------------------------------------------------------------------------------ failures


def test_init_raising_warns_once_and_the_run_completes(tmp_path, monkeypatch) -> None:
    import wandb

    def broken_init(*args, **kwargs):
        raise RuntimeError("W&B backend exploded")

    monkeypatch.setattr(wandb, "init", broken_init)
    _, caught = train(tmp_path, "logger.mode=offline")
    assert len(caught) == 1
    assert "W&B init failed (RuntimeError: W&B backend exploded)" in str(caught[0].message)
    assert "local logging only" in str(caught[0].message)
    assert_complete_locally(tmp_path)


def test_wandb_not_importable_warns_once_and_the_run_completes(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    _, caught = train(tmp_path, "logger.mode=offline")
    assert len(caught) == 1
    assert re.match(r"W&B import failed \((ModuleNotFound|Import)Error", str(caught[0].message))
    assert_complete_locally(tmp_path)


def test_log_raising_midway_warns_once_and_loses_nothing_locally(tmp_path, monkeypatch) -> None:
    from wandb.sdk.wandb_run import Run

    calls = []

    def disk_full(self, *args, **kwargs):
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Run, "log", disk_full)
    _, caught = train(tmp_path, "logger.mode=offline")
    assert len(calls) == 1  # after the first failure W&B is left alone
    assert len(caught) == 1
    assert "W&B log failed (OSError: [Errno 28] No space left on device)" in str(caught[0].message)
    assert_complete_locally(tmp_path)


def test_disabled_mode_makes_no_wandb_files_and_never_imports_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    _, caught = train(tmp_path, "logger.mode=disabled")
    assert caught == []
    assert_complete_locally(tmp_path)
    assert not [p for p in tmp_path.rglob("*") if "wandb" in p.name]


def test_offline_run_lives_in_the_run_folder_and_prints_the_sync_command(tmp_path, capsys) -> None:
    summary, caught = train(tmp_path, "logger.mode=offline", "logger.tags=[mine]")
    assert caught == []
    run = read_offline_run(tmp_path / "wandb")
    assert run["folder"].parent == tmp_path / "wandb"
    # Outside a Hydra app: group = experiment name, name = the run folder's name.
    assert (run["group"], run["name"], run["tags"]) == ("smoke", tmp_path.name, ["mine"])
    assert [row["step"] for row in run["history"]] == [0, 1]
    assert run["summary"]["reward/final"] == pytest.approx(summary["reward/final"])
    out = capsys.readouterr().out
    assert f"wandb sync {run['folder']}" in out


def test_forced_online_without_a_key_goes_offline_with_one_warning(tmp_path) -> None:
    logger_cfg = OmegaConf.create(
        {
            "mode": "online",
            "project": "rlhf_lab",
            "entity": None,
            "group": None,
            "run_name": None,
            "tags": [],
            "job_type": "train",
            "samples_every": 1,
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = WandbTracker(logger_cfg, {"experiment_name": "t", "seed": 0}, tmp_path)
        tracker.log({"reward/mean": 1.0}, 0)
        tracker.finish({"reward/final": 1.0})
    caught = [w for w in caught if issubclass(w.category, WandbUnavailableWarning)]
    assert tracker.mode == "offline"
    assert len(caught) == 1 and "no W&B API key" in str(caught[0].message)
    assert read_offline_run(tmp_path / "wandb")["summary"]["reward/final"] == 1.0


def test_only_rank_zero_of_a_torchrun_job_opens_a_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    logger_cfg = OmegaConf.create({"mode": "offline", "project": "rlhf_lab", "tags": []})
    tracker = WandbTracker(logger_cfg, {"experiment_name": "t"}, tmp_path / "run")
    tracker.log({"reward/mean": 1.0}, 0)
    tracker.finish({})
    assert (tracker.mode, tracker.run) == ("disabled", None)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ mode


def test_mode_auto_is_offline_without_a_key(tmp_path) -> None:
    environ = {"NETRC": str(tmp_path / "missing")}
    assert not has_api_key(environ)
    assert resolve_mode("auto", environ) == "offline"


def test_mode_auto_is_online_with_an_api_key(tmp_path) -> None:
    environ = {"NETRC": str(tmp_path / "missing"), "WANDB_API_KEY": "fake-key-" + "0" * 31}
    assert has_api_key(environ)
    assert resolve_mode("auto", environ) == "online"


def test_mode_auto_reads_the_netrc_entry_for_the_wandb_host(tmp_path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password fake-key\n")
    netrc.chmod(0o600)
    assert resolve_mode("auto", {"NETRC": str(netrc)}) == "online"
    # An entry for another host is not a key for this one; WANDB_BASE_URL picks the host.
    assert resolve_mode("auto", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"
    netrc.write_text("machine wandb.example.org login user password fake-key\n")
    assert resolve_mode("auto", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"}) == "online"
    netrc.write_text('this is not a netrc file "\n')
    assert resolve_mode("auto", {"NETRC": str(netrc)}) == "offline"


def test_forced_modes_and_wandb_mode_env(tmp_path) -> None:
    keyed = {"NETRC": str(tmp_path / "missing"), "WANDB_API_KEY": "fake"}
    for mode in ("online", "offline", "disabled"):
        assert resolve_mode(mode, {}) == mode
    assert resolve_mode("auto", {**keyed, "WANDB_MODE": "offline"}) == "offline"
    assert resolve_mode("auto", {**keyed, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_mode("auto", {**keyed, "WANDB_MODE": "online"}) == "online"
    with pytest.raises(ValueError, match="logger.mode='sometimes' is not valid"):
        resolve_mode("sometimes", {})


# ------------------------------------------------------------------------------------------ names


def _hydra_cfg(mode: str, sweep_dir: Path, task: list[str], choices: dict) -> Any:
    from hydra.types import RunMode

    return OmegaConf.create(
        {
            "mode": RunMode[mode],
            "sweep": {"dir": str(sweep_dir)},
            "runtime": {"output_dir": str(sweep_dir / "3_x"), "choices": choices},
            "overrides": {"task": task},
            "job": {
                "num": 3,
                "override_dirname": ",".join(sorted(t for t in task if not t.startswith("logger"))),
                "config": {"override_dirname": {"exclude_keys": ["experiment", "logger", "logger.mode"]}},
            },
        }
    )


def test_multirun_name_and_tags_are_the_swept_overrides_only(tmp_path) -> None:
    sweep_dir = tmp_path / "multirun_2026-01-01_00-00-00"
    sweep_dir.mkdir()
    # The sweep as Hydra saves it: command-line sweeps plus the experiment's sweeper params.
    OmegaConf.save(
        {
            "hydra": {
                "overrides": {"task": ["model=tiny", "algorithm=grpo,rloo", "+experiment=e", "logger=wandb"]},
                "sweeper": {"params": {"kl": "k3,kl", "seed": "0,1,2"}},
            }
        },
        sweep_dir / "multirun.yaml",
    )
    task = ["kl=kl", "seed=2", "model=tiny", "algorithm=rloo", "+experiment=e", "logger=wandb"]
    choices = {"algorithm": "rloo", "kl": "kl", "experiment": "e", "hydra/launcher": "basic"}
    identity = run_identity("e", sweep_dir / "3_x", _hydra_cfg("MULTIRUN", sweep_dir, task, choices))
    assert identity.group == "e-multirun_2026-01-01_00-00-00"
    assert identity.name == "algorithm=rloo,kl=kl,seed=2"
    assert identity.tags == ["algorithm=rloo", "kl=kl", "seed=2"]
    config = dashboard_config(
        {"algorithm": {"name": "reinforce"}, "kl": {"name": "kl", "placement": "loss"}, "seed": 2},
        sweep_dir / "3_x",
        identity,
    )
    assert (config["algorithm_name"], config["kl_name"], config["kl_placement"]) == ("rloo", "kl", "loss")
    assert config["algorithm"] == {"name": "reinforce"} and config["experiment"] == "e"

    # Without multirun.yaml the name falls back to every override but the excluded ones.
    (sweep_dir / "multirun.yaml").unlink()
    identity = run_identity("e", sweep_dir / "3_x", _hydra_cfg("MULTIRUN", sweep_dir, task, choices))
    assert identity.name == "algorithm=rloo,kl=kl,model=tiny,seed=2"


def test_single_run_identity(tmp_path) -> None:
    task = ["algorithm=rloo", "logger=wandb", "trainer.steps=3", "kl.coef=0.30000000000000004"]
    hydra_cfg = _hydra_cfg("RUN", tmp_path, task, {"algorithm": "rloo", "kl": "k3", "logger": "wandb"})
    identity = run_identity("default", tmp_path / "2026-01-01_00-00-00", hydra_cfg)
    # The group is the arm (not "default"); the tags are the options chosen (less the excluded logger), not every
    # setting.
    assert (identity.group, identity.tags) == ("rloo-k3", ["algorithm=rloo"])
    assert run_identity("exp", tmp_path / "x", hydra_cfg).group == "exp"
    identity = run_identity("default", tmp_path / "2026-01-01_00-00-00", _hydra_cfg("RUN", tmp_path, [], {}))
    assert (identity.name, identity.group) == ("2026-01-01_00-00-00", "default")


def test_tags_drop_prefixes_and_long_floats(tmp_path) -> None:
    sweep_dir = tmp_path / "multirun_2026-01-01_00-00-00"
    sweep_dir.mkdir()
    OmegaConf.save({"hydra": {"overrides": {"task": ["+kl_arm=kl_loss,abs_reward", "kl.coef=range(0.1,0.4,0.1)"]},
                              "sweeper": {"params": {}}}}, sweep_dir / "multirun.yaml")
    task = ["+kl_arm=abs_reward", "kl.coef=0.30000000000000004", "model=tiny"]
    identity = run_identity("e", sweep_dir / "1_x", _hydra_cfg("MULTIRUN", sweep_dir, task, {"kl_arm": "abs_reward"}))
    assert identity.tags == ["kl.coef=0.3", "kl_arm=abs_reward"]
    assert identity.name == "kl.coef=0.3,kl_arm=abs_reward"


def test_job_type_names_the_stage() -> None:
    from rlhf_lab.trackers.wandb_run import job_type

    assert job_type(None, {"algorithm": {"name": "grpo"}}) == "train"
    assert [job_type(None, {"algorithm": {"name": n}}) for n in ("sft", "dpo", "reward_model")] == [
        "sft", "dpo", "reward_model"]
    assert job_type(None, {"algorithm": {"name": "grpo"}, "evaluates": {"step": 3}}) == "eval"
    assert job_type("pipeline/rm", {"algorithm": {"name": "reward_model"}}) == "pipeline/rm"
