"""CLI polish: ``--help`` names rlhf-lab, its sub-commands, experiments and launchers; ``--version`` is
rlhf_lab's; shell completion installs and answers; sub-commands are listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lab import __version__
from rlhf_lab.app.cli import SUBCOMMANDS, main
from tests.limits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def rlhf_lab(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_lab", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_version_is_rlhf_labs(capsys) -> None:
    main(["--version"])
    assert capsys.readouterr().out.startswith(f"rlhf-lab {__version__} (hydra-core ")


def test_help_names_the_program_subcommands_experiments_and_launchers() -> None:
    result = rlhf_lab("--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("rlhf-lab: RLHF research")
    for sub in SUBCOMMANDS:
        assert f"rlhf-lab {sub} " in text, sub
    assert "experiment: " in text and "kl_ablation" in text and "smoke" in text
    assert "hydra/launcher=NAME: basic" in text and "joblib_local" in text
    assert "_schema" not in text.split("== Config (")[0]  # schemas are not options


def test_shell_completion_installs_and_answers() -> None:
    installed = rlhf_lab("-sc", "install=bash")
    assert installed.returncode == 0 and "hydra_bash_completion" in installed.stdout
    answer = rlhf_lab("-sc", "query=bash", env={"COMP_LINE": "rlhf-lab algorithm="})
    assert answer.returncode == 0 and "algorithm=grpo" in answer.stdout


def test_the_pipeline_is_a_subcommand(capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["pipeline", "--help"])
    assert raised.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: rlhf-lab pipeline") and "--arms" in usage
