"""Plug-ins: a user's package registers a reward and a KL estimator; its options come from Hydra's search path.

The tiny package is written into a temp folder: through the CLI it is found by its ``rlhf_lab.plugins`` entry
point (a ``dist-info`` with ``entry_points.txt`` on ``PYTHONPATH``); in-process, through the ``plugins`` key and
``rlhf_lab.train``. Both train ``model=tiny`` for one step with the plug-in's reward and estimator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lab.config.compose import compose
from rlhf_lab.errors import ConfigError
from tests.limits import HANG_GUARD_S

PLUGIN = '''
from dataclasses import dataclass

import torch
from hydra.core.config_store import ConfigStore

from rlhf_lab.config.schema import RewardConfig
from rlhf_lab.envs.base import Environment, StepResult
from rlhf_lab.registry import register
from rlhf_lab.rewards.base import Reward, RewardOutput


@dataclass
class ConstantRewardConfig(RewardConfig):
    value: float = 0.5


ConfigStore.instance().store(group="reward", name="{name}_constant_schema", node=ConstantRewardConfig)


@register("reward", "{name}_constant")
class ConstantReward(Reward):
    name = "{name}_constant"
    config_fields = ("value",)

    def score(self, prompts, responses):
        return RewardOutput(scores=torch.full((len(responses),), float(self.option("value", 0.5))))


@register("env", "{name}_echo")
class Echo(Environment):
    """Two turns: "again" after the first (reward 0.25), then over (0.5)."""

    name = "{name}_echo"

    def reset(self, task, seed):
        return [{"role": "user", "content": "Say something."}]

    def step(self, assistant_message, state):
        if state.turn < 2:
            return StepResult([{"role": "user", "content": "Again."}], 0.25, False, {"echoes": 1.0})
        return StepResult(None, 0.5, True, {"echoes": 1.0})


@register("kl", "{name}_quarter")
def quarter(logprobs, ref_logprobs, logits=None, ref_logits=None, **options):
    """A constant 0.25 per token (with k1's gradient): easy to recognise in kl/estimate."""
    return (logprobs - ref_logprobs) - (logprobs - ref_logprobs).detach() + 0.25
'''


def write_plugin(root: Path, name: str, entry_point: bool) -> Path:
    package = root / name
    (package / "conf" / "reward").mkdir(parents=True)
    (package / "conf" / "kl").mkdir(parents=True)
    (package / "conf" / "env").mkdir(parents=True)
    (package / "conf" / "env" / f"{name}_echo.yaml").write_text(
        f"defaults:\n  - env_schema\n  - _self_\nname: {name}_echo\nmax_turns: 3\nmax_tokens: 64\n")
    (package / "__init__.py").write_text(PLUGIN.replace("{name}", name))
    (package / "conf" / "__init__.py").write_text("")
    (package / "conf" / "reward" / f"{name}_constant.yaml").write_text(
        f"defaults:\n  - {name}_constant_schema\n  - _self_\nname: {name}_constant\nvalue: 0.75\n")
    (package / "conf" / "kl" / f"{name}_quarter.yaml").write_text(
        f"defaults:\n  - kl_schema\n  - _self_\nname: {name}_quarter\ncoef: 0.05\nplacement: loss\n")
    if entry_point:
        info = root / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[rlhf_lab.plugins]\n{name} = {name}\n")
    return root


TINY = ["model=tiny", "trainer.steps=1", "trainer.eval_prompts=2", "trainer.progress_bar=false",
        "algorithm.group_size=2", "trainer.prompts_per_step=2", "trainer.max_new_tokens=4"]


def test_entry_point_plugin_trains_with_its_reward_and_estimator_through_the_cli(tmp_path: Path) -> None:
    site = write_plugin(tmp_path / "site", "ep_plugin", entry_point=True)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "rlhf_lab", *TINY, "reward=ep_plugin_constant", "kl=ep_plugin_quarter",
               "hydra.searchpath=[pkg://ep_plugin.conf]", f"trainer.output_dir={run_dir}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    assert step["reward/mean"] == pytest.approx(0.75)
    assert step["kl/estimate"] == pytest.approx(0.25)


def test_plugins_key_and_python_api_train_with_the_plugin(tmp_path: Path, monkeypatch) -> None:
    import rlhf_lab
    from rlhf_lab import registry

    site = write_plugin(tmp_path / "site", "key_plugin", entry_point=False)
    monkeypatch.syspath_prepend(str(site))
    # The plug-in's registrations and module live only for this test (other files may share the process).
    monkeypatch.setattr(registry, "_REGISTRY", {kind: dict(parts) for kind, parts in registry._REGISTRY.items()})
    monkeypatch.setitem(sys.modules, "key_plugin", None)  # undone last: the module is unloaded again
    monkeypatch.delitem(sys.modules, "key_plugin")
    overrides = [*TINY, "plugins=[key_plugin]", "reward=key_plugin_constant", "kl=key_plugin_quarter",
                 f"hydra.searchpath=[file://{site / 'key_plugin' / 'conf'}]"]
    cfg = rlhf_lab.compose(overrides)
    assert cfg.reward.value == 0.75 and list(cfg.plugins) == ["key_plugin"]
    # The plug-in's options are listed in the one-line error's choices.
    with pytest.raises(ConfigError, match=r"^reward='nope' is not an option; choose from: .*key_plugin_constant"):
        rlhf_lab.compose(["model=tiny", "reward=nope", overrides[-1]])
    summary = rlhf_lab.train(overrides, run_dir=tmp_path / "run")
    assert summary["reward/final"] == pytest.approx(0.75)
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_a_plugin_environment_plays_its_episodes(tmp_path: Path, monkeypatch) -> None:
    import rlhf_lab
    from rlhf_lab import registry

    site = write_plugin(tmp_path / "site", "env_plugin", entry_point=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_REGISTRY", {kind: dict(parts) for kind, parts in registry._REGISTRY.items()})
    monkeypatch.setitem(sys.modules, "env_plugin", None)
    monkeypatch.delitem(sys.modules, "env_plugin")
    # 16 tokens a turn, ended by any of these stop strings: the random tiny model's turns all end before the limit
    overrides = [*TINY, "plugins=[env_plugin]", "env=env_plugin_echo", "trainer.max_new_tokens=16",
                 "env.stop=[a,e,i,o,u,n,t,s,r,l]", "trainer.eval_prompts=0",
                 f"hydra.searchpath=[file://{site / 'env_plugin' / 'conf'}]"]
    rlhf_lab.train(overrides, run_dir=tmp_path / "run")
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["env/turns_mean"] == 2.0 and step["env/echoes"] == 2.0 and step["env/truncated_frac"] == 0.0
    assert step["reward/mean"] == pytest.approx(0.75)  # 0.25 for the first turn, 0.5 for the second


def test_plugin_that_fails_to_import_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"^plugins: 'no_such_plugin_pkg' failed to import \(ModuleNotFoundError"):
        compose(["model=tiny", "plugins=[no_such_plugin_pkg]"])


def test_unknown_search_path_package_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"hydra.searchpath: package 'no_such_pkg.conf'"):
        compose(["model=tiny", "hydra.searchpath=[pkg://no_such_pkg.conf]"])


def test_python_api_refuses_a_sweep() -> None:
    import rlhf_lab

    with pytest.raises(ConfigError, match="rlhf_lab.train runs one job"):
        rlhf_lab.train(["model=tiny", "seed=0,1"])


def test_entry_point_that_fails_to_import_is_one_line_naming_it(monkeypatch) -> None:
    from rlhf_lab.app import plugins

    class Broken:
        name, value = "broken", "broken_pkg.parts"

        def load(self):
            raise ImportError("No module named 'broken_pkg'")

    monkeypatch.setattr(plugins, "installed_entry_points", lambda: [Broken()])
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    with pytest.raises(ConfigError, match=r"^plug-in entry point 'broken' \(rlhf_lab.plugins: broken_pkg.parts\) failed "
                                          r"to import: ImportError: No module named 'broken_pkg'$"):
        plugins.load_plugins([])
