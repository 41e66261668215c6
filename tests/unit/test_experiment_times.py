"""Every ready-made experiment states its measured wall time, and the command line prints it at launch."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rlhf_lab.app.cli import say_experiment_time
from rlhf_lab.config import compose

EXPERIMENTS = Path(__file__).resolve().parents[2] / "conf" / "experiment"


def test_every_experiment_states_a_measured_time() -> None:
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        stated = yaml.safe_load(path.read_text()).get("experiment_time")
        assert stated and re.search(r"\d+ (s|min|h)\b", stated), path.name  # a number with its unit, not "a few"
        assert "2 CPU cores" in stated, path.name  # on what it was measured


def test_the_time_is_printed_when_the_experiment_starts(capsys) -> None:
    cfg = compose(["experiment=kl_ablation"])
    capsys.readouterr()  # composing warns about the sweep's arms
    say_experiment_time(cfg)
    assert capsys.readouterr().err.startswith("experiment=kl_ablation: about 1 h 25 min on 2 CPU cores: 36 jobs")
    say_experiment_time(compose(["model=tiny"]))  # a plain run states nothing
    assert capsys.readouterr().err == ""
