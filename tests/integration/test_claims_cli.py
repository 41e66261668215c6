"""A bad claim in an experiment is one line before any job starts (rlhf_lab/config/claims.py), from the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_bad_claim_on_the_command_line_stops_before_any_job(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "experiment=kl_to_go", 'claims.0.b="kl_arm=k9_loss"',
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("error: claim 'to_go_beats_per_position': b='kl_arm=k9_loss' names no arm of the "
                         "experiment's sweep (swept keys: kl_arm)"), result.stderr
    assert not (tmp_path / "sweep").exists()
