"""The metric names the code logs are in docs/reference/metrics.md, and every name there is logged (``<k>`` stands
for a mode's index): the mode-collapse, diversity and reward-rescale names from the functions that make them, then
every name both ways from the package's source, and the names docs/concepts/algorithms.md mentions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from rlhf_lab.testbed.modes import mode_metrics
from rlhf_lab.training.diversity import group_metrics

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


def documented() -> set[str]:
    return set(re.findall(r"`([a-z_]+(?:/[a-z_@<>0-9]+)+)`", METRICS_PAGE.read_text(encoding="utf-8")))


def test_every_logged_name_is_documented() -> None:
    log_ref = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64).log()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    names = set(mode_metrics(log_ref, log_ref, log_ref, rewards))
    names |= set(group_metrics(torch.ones(16), ["a b"] * 16, 16, threshold=1.0))
    names |= {"reward/task"}  # rlhf_lab/step/experience.py, under reward.rescale
    names = {re.sub(r"/\d+$", "/<k>", name) for name in names}
    assert names <= documented(), names - documented()


# ----------------------------------------------------------------------------- every name, both ways
# The code's names are read from its source: each string constant shaped like a metric name, and each f-string
# (``f"time/{name}_s"``) as a template. The page's names are its backquoted ones, ``<...>`` a template.

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_lab"
NAME = re.compile(r"[a-z_0-9]+(?:/[a-z_0-9@]+)+")
TEMPLATE = re.compile(r"[a-z_0-9{}@]*(?:/[a-z_0-9{}@]*)*")
# Slash-shaped strings of the package that are not metric names (MIME types, file stems, registry names, the
# W&B job type and claim-table labels), and the wrappers that prefix every key of a line (``eval/…``, ``before/…``).
NOT_METRICS = {"application/json", "samples/step_", "eval_samples/step_", "rlhf_lab/rank_0_said", "s/step",
               "reinforce/batch_mean", "reinforce/loo", "reinforce/none", "claims/{}/{}", "pipeline/{}", "eval/{}",
               "before/{}"}


def code_names() -> tuple[set[str], set[str]]:
    """(metric-shaped string constants, f-string templates with ``{}`` for each placeholder) of the package."""
    names, templates = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstrings:
                if NAME.fullmatch(node.value):
                    names.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in node.values)
                if "{}" in text and TEMPLATE.fullmatch(text) and re.search(r"[a-z]", text):
                    templates.add(text)
    names = {n.removeprefix("before/") for n in names}  # the summary's first evaluation: its eval/ keys, prefixed
    return names - NOT_METRICS, templates - NOT_METRICS


def pattern(template: str, placeholder: str) -> re.Pattern[str]:
    """The names ``template`` (``placeholder`` marks its parts) stands for; each part one word, no slash."""
    return re.compile("[a-z_0-9@]+".join(re.escape(part) for part in re.split(placeholder, template)))


def code_patterns(templates: set[str]) -> list[re.Pattern[str]]:
    """The names the code's templates log: ``time/{}_s``, and a key behind a prefix variable (``f"{prefix}pass@{k}"``,
    the prefix ``eval/`` or none)."""
    patterns = [pattern(t, r"\{\}") for t in templates if "/" in t]
    keys = [t.removeprefix("{}") for t in templates if "/" not in t and t.startswith("{}")]
    return patterns + [re.compile(r"(?:eval/)?" + pattern(k, r"\{\}").pattern) for k in keys]


def test_every_metric_name_the_code_logs_is_on_the_page_and_every_name_there_is_logged() -> None:
    names, templates = code_names()
    page = documented()
    page_names = {n for n in page if "<" not in n}
    page_templates = [pattern(n, r"<[a-z]+>") for n in page if "<" in n]
    namespaces = {n.split("/")[0] for n in page}
    metrics = {n for n in names if n.split("/")[0] in namespaces}
    assert names == metrics, f"names outside the page's namespaces: {sorted(names - metrics)}"
    undocumented = {n for n in metrics if n not in page_names and not any(t.fullmatch(n) for t in page_templates)}
    assert not undocumented, f"logged, not in docs/reference/metrics.md: {sorted(undocumented)}"
    metric_templates = {t for t in templates if "/" in t and t.split("/")[0] in namespaces}
    page_as_templates = {re.sub(r"<[a-z]+>", "{}", n) for n in page}
    unmatched = {t for t in metric_templates if t not in page_as_templates
                 and not any(pattern(t, r"\{\}").fullmatch(n) for n in page_names)}
    assert not unmatched, f"logged by a template that names nothing in docs/reference/metrics.md: {sorted(unmatched)}"
    logged_by = code_patterns(templates)
    stale = {n for n in page_names if n not in names and not any(p.fullmatch(n) for p in logged_by)}
    assert not stale, f"in docs/reference/metrics.md, logged nowhere: {sorted(stale)}"


def test_the_algorithms_page_names_what_the_code_logs() -> None:
    text = (METRICS_PAGE.parent.parent / "concepts" / "algorithms.md").read_text(encoding="utf-8")
    names, templates = code_names()
    mentioned = set(re.findall(r"`([a-z_]+/[a-z_]+)`", text))
    logged = {n for n in mentioned if n in names or any(p.fullmatch(n) for p in code_patterns(templates))}
    assert "rollout/is_weight_mean" in mentioned and mentioned == logged, sorted(mentioned - logged)
