"""The console and help: no library progress bars by default, a progress line for evaluation, plain-text --help,
"did you mean" on a mistyped option, key or value, the thread hint, and the workspace spec without --entity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.config import compose
from rlhf_lab.config.suggest import did_you_mean
from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime.console import library_progress_bars
from rlhf_lab.training.setup import thread_hint


def test_did_you_mean_by_difflib() -> None:
    assert did_you_mean("sentimnt", ["sentiment", "length"]) == "did you mean 'sentiment'? "
    assert did_you_mean("zzz", ["sentiment", "length"]) == ""
    with pytest.raises(ConfigError, match=r"^reward='sentimnt' is not an option; did you mean 'sentiment'\? choose "):
        compose(["model=tiny", "reward=sentimnt"])
    with pytest.raises(ConfigError, match=r"^unknown key 'trainer.stpes'; did you mean 'trainer.steps'\? valid keys"):
        compose(["model=tiny", "trainer.stpes=3"])
    with pytest.raises(ConfigError, match=r"^trainer.lr_schedule='cosin' is not valid; did you mean 'cosine'\? "
                                          r"choose from: constant, linear, cosine$"):
        compose(["model=tiny", "trainer.lr_schedule=cosin"])


@pytest.mark.parametrize("command", ["serve", "pipeline", "report", "export", "eval", "bench"])
def test_help_is_plain_text(command: str, run_cli) -> None:
    code, printed, err = run_cli([command, "--help"])
    assert code == 0 and printed.startswith("usage: rlhf-lab"), err
    assert "``" not in printed and ":mod:" not in printed and ":func:" not in printed


def test_library_bars_are_off_in_a_run_by_default_and_restored_after() -> None:
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    assert compose(["model=tiny"]).trainer.library_progress_bars is False
    before = (transformers_logging.is_progress_bar_enabled(), datasets_logging.is_progress_bar_enabled())
    with library_progress_bars(False):
        assert not transformers_logging.is_progress_bar_enabled()
        assert not datasets_logging.is_progress_bar_enabled()
    assert (transformers_logging.is_progress_bar_enabled(), datasets_logging.is_progress_bar_enabled()) == before


def test_an_evaluation_says_it_started_and_how_far_it_is(tiny_overrides, tmp_path: Path, capsys) -> None:
    from rlhf_lab.training.loop import Trainer

    cfg = compose([*tiny_overrides(tmp_path), "trainer.steps=1", "trainer.eval_prompts=17",
                   "data.eval_fraction=0.2"])
    Trainer(cfg, tmp_path / "run").train()
    printed = capsys.readouterr().out
    for step in (0, 1):  # before and after training, in chunks of 16 prompts
        assert f"evaluation at step {step}: 17 held-out prompts × 1 sample" in printed
        assert f"evaluation at step {step}: 16/17 prompts (" in printed
        assert f"evaluation at step {step}: 17/17 prompts (" in printed


def test_the_thread_hint_comes_when_threads_would_wait_on_a_busy_cpu() -> None:
    line = thread_hint(0, 2, 3.4, 2)
    assert line.startswith("the CPU is busy before this run starts (load average 3.4 on 2 cores) and torch runs 2 "
                           "threads") and "set trainer.num_threads=1" in line and "\n" not in line
    assert thread_hint(0, 2, 0.3, 2) is None  # a quiet machine: the default is faster
    assert thread_hint(2, 2, 3.4, 2) is None  # chosen by the user
    assert thread_hint(0, 1, 3.4, 2) is None  # one thread already


def test_the_workspace_spec_needs_no_entity(tmp_path: Path, run_cli, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    out = tmp_path / "view.json"
    code, printed, err = run_cli(["wandb", "workspace", "--out", str(out)])
    assert code == 0, err
    assert json.loads(out.read_text())["project"] == "rlhf_lab" and printed.startswith(f"wrote {out}")
    code, _, err = run_cli(["wandb", "workspace", "--save"])
    assert code == 2 and err == ("error: --save needs --entity (the W&B user or team the view is saved under); --out "
                                 "writes the spec without one\n")


def test_help_lists_every_config_group_with_its_options() -> None:
    """``rlhf-lab --help``'s group list covers every folder of conf/ but Hydra's own (the environments and the sweeps'
    arm groups included), each with the options a user can select."""
    from rlhf_lab.app.cli_help import help_text
    from rlhf_lab.config.compose import CONF_DIR, group_options

    listed = {line.split(":")[0].strip(): line.split(": ", 1)[1] for line in help_text("groups").splitlines()}
    folders = {path.name for path in CONF_DIR.iterdir() if path.is_dir() and path.name != "hydra"}
    assert set(listed) == folders
    assert listed["env"] == ", ".join(group_options("env")) and "verifiers" in listed["env"]
    assert "f6_decoupled" in listed["async_arm"] and "s8_sequence" in listed["off_policy_arm"]
