"""The literature pages say only what the recorded runs show (docs/_writeups.py): each generated table is what its
results file regenerates, and every number of the prose is in a results file the page cites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "_writeups.py"


@pytest.fixture(scope="module")
def writeups():
    return load_script(SCRIPT, "writeups")


def test_every_literature_page_is_what_its_results_regenerate(writeups) -> None:
    pages = sorted(writeups.PAGES.glob("*.md"))
    assert len(pages) >= 6
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert writeups.regenerate(text) == text, f"stale table in {page.name}: run python docs/_writeups.py"
        assert writeups.untraced(page) == [], f"{page.name} states numbers no results file it cites holds"
    for name in ("kl-placement-bias", "kl-to-go", "grpo-kl-scale", "mode-collapse", "off-policy-kl"):
        text = (writeups.PAGES / f"{name}.md").read_text(encoding="utf-8")  # the five re-run under the claim rule
        assert "<!-- results claims experiments/results/" in text and "<!-- results arms " in text, name


def test_a_stale_table_and_an_untraced_number_are_found(writeups, tmp_path: Path, monkeypatch) -> None:
    results = tmp_path / "experiments" / "results" / "demo"
    results.mkdir(parents=True)
    summary = {"claims/better/verdict": "PASS", "claims/better/effect": -0.0296, "claims/better/ci_low": -0.0349,
               "claims/better/ci_high": -0.025, "claims/better/min_effect": 0.005, "claims/better/seeds": 10,
               "claims/better/seeds_needed": 7, "claims/better/metric": "final_gap"}
    (results / "claims.json").write_text(json.dumps(summary))
    (results / "report.csv").write_text("arm,n_seeds,final_gap_mean,final_gap_std\nkl_arm=kl_reward,10,0.000333,"
                                        "5.1e-05\nkl_arm=none,10,0.2036,0.0955\n")
    (results / "notes.json").write_text(json.dumps({"dropped": 0.0761}))
    monkeypatch.setattr(writeups, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Demo (arXiv 2512.21852)\n\n<!-- results claims experiments/results/demo -->\nold\n"
                    "<!-- /results -->\n\n<!-- results arms experiments/results/demo final_gap -->\n<!-- /results -->\n\n"
                    "k1 ends 0.0296 closer (experiments/results/demo); 7.6% dropped; none 0.204; 0.31 is made up; "
                    "`kl.coef=0.123` is code.\n", encoding="utf-8")
    fresh = writeups.regenerate(page.read_text(encoding="utf-8"))
    assert "| `better` | — | final_gap | PASS | −0.0296 | [−0.0349, −0.025] | 0.005 | 10 (7) |" in fresh
    assert "| `kl_arm=kl_reward` | 10 | 0.000333 ± 5.1e−05 |" in fresh and "| `kl_arm=none` | 10 | 0.204 ± 0.0955 |" in fresh
    page.write_text(fresh, encoding="utf-8")
    assert writeups.regenerate(fresh) == fresh  # generating again changes nothing
    assert writeups.untraced(page) == ["0.31"]  # 0.0296, 7.6% (0.0761), 0.204 (0.2036) traced; code and arXiv ids not numbers
