"""``rlhf-lab report`` skips a job folder it cannot read, with one warning line naming the file and the
problem, and reports the others; an ``--out`` that is a file is one error line (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlhf_lab.tools.report import build_report, main


def job(folder: Path, seed: int, metrics: bytes | None = None, config: bytes | None = None) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_bytes(
        config if config is not None else yaml.safe_dump({"seed": seed, "trainer": {"steps": 2}}).encode())
    lines = [{"step": step, "reward/mean": 0.1 * step, "kl/estimate": 0.01, "kl/exact": 0.01, "time/step_s": 0.1}
             for step in (0, 1)]
    (folder / "metrics.jsonl").write_bytes(
        metrics if metrics is not None else "".join(json.dumps(line) + "\n" for line in lines).encode())
    return folder


GOOD_LINE = b'{"step": 0, "reward/mean": 0.5, "kl/exact": 0.1}\n'
MALFORMED = {
    "invalid_yaml": (dict(config=b"seed: [0\ntrainer: {steps: 2\n"), ".hydra/config.yaml", "invalid YAML or config"),
    "bare_number_line": (dict(metrics=GOOD_LINE + b"5\n"), "metrics.jsonl", "line 2 is not a JSON object (5)"),
    "metrics_not_utf8": (dict(metrics=GOOD_LINE + b'{"step": 1, "note": "caf\xe9"}\n'), "metrics.jsonl",
                         "not valid UTF-8"),
    "config_not_utf8": (dict(config=b"seed: 0\nname: caf\xe9\n"), ".hydra/config.yaml", "not valid UTF-8"),
    "non_numeric_step": (dict(metrics=GOOD_LINE + b'{"step": "three", "reward/mean": 0.2}\n'), "metrics.jsonl",
                         "line 2: step 'three' is not a number"),
}


def test_malformed_jobs_are_skipped_with_one_warning_each(tmp_path: Path, capsys) -> None:
    job(tmp_path / "0_good", seed=0)
    job(tmp_path / "1_good", seed=1)
    for index, (name, (files, _, _)) in enumerate(MALFORMED.items(), start=2):
        job(tmp_path / f"{index}_{name}", seed=index, **files)
    table, rows = build_report(tmp_path)
    assert [row["n_seeds"] for row in rows] == [2]  # the two readable jobs
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == len(MALFORMED)
    for index, (name, (_, file, problem)) in enumerate(MALFORMED.items(), start=2):
        folder = tmp_path / f"{index}_{name}"
        line = next(w for w in warnings if w.startswith(f"warning: skipping {folder}: "))
        assert f"{folder / file}: " in line and problem in line, line


def test_an_out_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    job(tmp_path / "0_good", seed=0)
    (tmp_path / "taken").write_text("x")
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path), "--out", str(tmp_path / "taken")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'taken'} is a file, not a folder\n"
