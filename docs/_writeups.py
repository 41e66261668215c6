"""The literature pages' measured tables, regenerated from the results the repository holds, and every number their
prose states traced to those results.

    python docs/_writeups.py            # rewrite each generated block of docs/literature/*.md from its results
    python docs/_writeups.py --check    # exit 1, naming each stale block and each number no source holds

A generated block is written between two comments:

    <!-- results claims experiments/results/NAME -->  ... <!-- /results -->
        the claims' verdicts from NAME/claims.json (with the replication beside them, when it ran)
    <!-- results arms experiments/results/NAME COLUMN,COLUMN,... -->  ... <!-- /results -->
        one row per arm from NAME/report.csv (its order: the report's ranking), mean ± sd over seeds

A page's **sources** are the results folders its blocks or its text name (``experiments/results/...``): their
report.csv, claims.json and report.md, and the YAML of the experiment the page runs. Every number with a decimal
point in the page's prose (outside generated blocks and code) must be one of theirs at the precision it is printed
(0.0296 stands for any value that rounds to it, 7.6% for a fraction that rounds to 0.076; a sign is ignored, so a
difference may be quoted as a distance; an arXiv identifier is not a number). A
number quoted from a paper rather than measured is listed in the page, visibly, as ``Quoted from the paper: ...``.
tests/unit/test_writeups.py runs the check.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "literature"
BLOCK = re.compile(r"<!-- results (claims|arms) (\S+)(?: (\S+))? -->\n(.*?)<!-- /results -->", re.S)
SOURCE = re.compile(r"experiments/results/[\w.\-]+")
NUMBER = re.compile(r"(?<![\w.])[−-]?\d+\.\d+(?:e[−-]?\d+)?%?(?![\w.])")
ARXIV = re.compile(r"^\d{4}\.\d{4,5}$")  # a paper's identifier, not a measurement
QUOTED = re.compile(r"Quoted from the paper: ([^\n]*)")
HEADERS = {"final_gap": "final gap J* − J", "final_kl_sequence": "KL(π‖π_ref)", "final_tv": "TV to π*",
           "kl_to_optimal": "KL(π‖π*)", "diverged": "diverged (share of seeds)", "modes_effective": "effective modes",
           "mode_coverage": "mode coverage", "mode_mass": "mass on modes", "final_entropy": "H(π)",
           "length_bias": "length − π*'s", "final_length": "mean length", "estimate_bias": "estimate bias"}


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.3g}".replace("-", "−")


def claims_block(folder: Path) -> str:
    summary = json.loads((folder / "claims.json").read_text(encoding="utf-8"))
    names = list(dict.fromkeys(key.split("/")[1] for key in summary))
    replicated = any(f"claims/{name}/replicate_verdict" in summary for name in names)
    lines = ["| claim | comparison | metric | verdict | effect | interval | min effect | seeds (needed) |"
             + (" at fresh seeds |" if replicated else ""),
             "| --- | --- | --- | --- | ---: | --- | ---: | ---: |" + (" --- |" if replicated else "")]
    for name in names:
        def get(field: str, name: str = name) -> object:
            return summary.get(f"claims/{name}/{field}")
        low, high = get("ci_low"), get("ci_high")
        interval = "—" if low is None or math.isnan(low) else f"[{_number(low)}, {_number(high)}]"
        needed = get("seeds_needed")
        line = (f"| `{name}` | {get('comparison') or '—'} | {get('metric')} | {get('verdict')} | {_number(get('effect'))} | {interval} | "
                f"{_number(get('min_effect'))} | {get('seeds')} ({'—' if needed is None else needed}) |")
        if replicated:
            again = get("replicate_verdict")
            flag = " (changed)" if get("replicate_flipped") else ""
            interval_again = str(get("replicate_interval")).replace("-", "−")  # the page's minus, as _number's
            line += (f" {again}{flag}: {_number(get('replicate_effect'))} {interval_again} |"
                     if again else " — |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def arms_block(folder: Path, columns: str) -> str:
    with open(folder / "report.csv", encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    wanted = columns.split(",")
    lines = ["| arm | seeds | " + " | ".join(HEADERS.get(column, column) for column in wanted) + " |",
             "| --- | ---: |" + " ---: |" * len(wanted)]
    for row in rows:
        cells = []
        for column in wanted:
            mean, sd = float(row.get(f"{column}_mean") or "nan"), float(row.get(f"{column}_std") or "nan")
            cells.append(_number(mean) if math.isnan(sd) else f"{_number(mean)} ± {_number(sd)}")
        lines.append(f"| `{row['arm']}` | {row['n_seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def regenerate(text: str) -> str:
    def block(match: re.Match) -> str:
        kind, folder, columns = match.group(1), ROOT / match.group(2), match.group(3)
        body = claims_block(folder) if kind == "claims" else arms_block(folder, columns)
        head = f"<!-- results {kind} {match.group(2)}{' ' + columns if columns else ''} -->"
        return f"{head}\n{body}<!-- /results -->"

    return BLOCK.sub(block, text)


def _source_numbers(page: Path, text: str) -> set[float]:
    values: set[float] = set()
    for cited in set(SOURCE.findall(text)):
        folder = ROOT / cited
        files = [path for path in folder.iterdir() if path.suffix in (".csv", ".json", ".md")] if folder.is_dir() \
            else [folder]
        for path in files:
            if path.is_file():
                values.update(abs(float(x)) for x in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", path.read_text("utf-8")))
    for experiment in re.findall(r"experiment=(\w+)", text):
        path = ROOT / "conf" / "experiment" / f"{experiment}.yaml"
        if path.is_file():
            values.update(abs(float(x)) for x in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", path.read_text("utf-8")))
    for quoted in QUOTED.findall(text):
        values.update(abs(float(x.replace("−", "-"))) for x in NUMBER.findall(quoted))
    return values


def _prose(text: str) -> str:
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


def untraced(page: Path) -> list[str]:
    """The numbers of ``page``'s prose that none of its sources holds at their printed precision."""
    text = page.read_text(encoding="utf-8")
    sources = _source_numbers(page, text)
    missing = []
    for printed in NUMBER.findall(_prose(text)):
        if ARXIV.match(printed):
            continue
        percent = printed.endswith("%")
        printed = printed.rstrip("%")
        value = abs(float(printed.replace("−", "-"))) / (100 if percent else 1)
        mantissa = printed.split("e")[0]
        digits = len(mantissa.split(".")[1])
        exponent = int(printed.split("e")[1].replace("−", "-")) if "e" in printed else 0
        step = 10.0 ** (exponent - digits) / (100 if percent else 1)
        if not any(abs(source - value) <= step / 2 + 1e-12 for source in sources):
            missing.append(printed)
    return missing


def main() -> None:
    check = "--check" in sys.argv[1:]
    problems = []
    for page in sorted(PAGES.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        fresh = regenerate(text)
        if fresh != text:
            if check:
                problems.append(f"{page.relative_to(ROOT)}: a generated block is stale; run python docs/_writeups.py")
            else:
                page.write_text(fresh, encoding="utf-8")
        for printed in untraced(page):
            problems.append(f"{page.relative_to(ROOT)}: {printed} is in no results file the page cites")
    for problem in problems:
        print(problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
