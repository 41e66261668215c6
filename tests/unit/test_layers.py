"""The package's floors: each module sits on one layer and imports only from its own layer or those below.

``LAYERS`` runs from the bottom up; a module belongs to the layer of the longest prefix that names it (a package's
plain-data modules, such as the config's schema, may sit below the package's other modules). ``CROSSINGS`` are the
imports that run back up on purpose, each with its reason; docs/concepts/architecture.md lists them too. A new
upward import fails here, and so does a listed crossing that the code no longer has (the list stays true).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_lab"

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: leaves: the errors, the registry (imports nothing of the package but the errors)
    ("rlhf_lab.errors", "rlhf_lab.registry"),
    # 1: plain data every floor reads: the config's shape (dataclasses, choices, override and sweep syntax), the
    #    exact task's definition, the job folders' naming
    ("rlhf_lab.config.schema", "rlhf_lab.config.schema_env", "rlhf_lab.config.schema_run", "rlhf_lab.config.schema_reward",
     "rlhf_lab.config.schema_offline", "rlhf_lab.config.choices", "rlhf_lab.config.overrides",
     "rlhf_lab.config.sweep_jobs", "rlhf_lab.config.sweep_arms", "rlhf_lab.config.conf_dir",
     "rlhf_lab.config.objective", "rlhf_lab.config.suggest",
     "rlhf_lab.testbed.task", "rlhf_lab.app.job_folders", "rlhf_lab.app.plugins", "rlhf_lab.app.help_text"),
    # 2: processes, precision, timing, the console
    ("rlhf_lab.runtime",),
    # 3: tensor math and prompts: masked means, log-probs, KL estimators, data
    ("rlhf_lab.masked", "rlhf_lab.scoring", "rlhf_lab.kl", "rlhf_lab.data"),
    # 4: the device's tuning
    ("rlhf_lab.hardware",),
    # 5: models and the engines that sample them
    ("rlhf_lab.models", "rlhf_lab.generation"),
    # 6: what the step plugs in: rewards, environments, algorithms (the offline ones with their data), the testbed
    ("rlhf_lab.rewards", "rlhf_lab.envs", "rlhf_lab.algorithms", "rlhf_lab.testbed", "rlhf_lab.offline.dpo",
     "rlhf_lab.offline.sft", "rlhf_lab.offline.reward_model", "rlhf_lab.offline.losses", "rlhf_lab.offline.data",
     "rlhf_lab.offline.batch", "rlhf_lab.offline.packing", "rlhf_lab.offline.stage"),
    # 7: where records go
    ("rlhf_lab.trackers",),
    # 8: the built-in parts, registered (rlhf_lab/components.py imports each to register it)
    ("rlhf_lab.components",),
    # 9: the RL step, and the planner that prices it
    ("rlhf_lab.step", "rlhf_lab.planner"),
    # 10: the run (loop, checkpoints, resume, records, evaluation) and the offline stages run on it
    ("rlhf_lab.training", "rlhf_lab.offline"),
    # 11: composing and checking a config against every part it names
    ("rlhf_lab.config",),
    # 12: the commands' tools, then the CLI and the API, then the package's face
    ("rlhf_lab.tools",),
    ("rlhf_lab.app",),
    ("rlhf_lab", "rlhf_lab.__main__"),
)

# importer -> imported: why it runs up. Each is imported where it is used (inside a function), so importing the lower
# module does not import the upper one.
CROSSINGS: dict[tuple[str, str], str] = {
    ("rlhf_lab.training.evaluation", "rlhf_lab.config.compose"):
        "an evaluation's extra rewards are composed from conf/ as `reward=NAME` would be, with the run's search path",
    ("rlhf_lab.trackers.wandb_sweep", "rlhf_lab.config.compose"):
        "`rlhf-lab wandb sweep` composes the sweep's config as the CLI does; it is a command living with its tracker",
    ("rlhf_lab.trackers.wandb_sweep", "rlhf_lab.config.validate_sweep"):
        "the same command checks the sweep's search space as `rlhf-lab sweep` does",
    ("rlhf_lab.config.claims", "rlhf_lab.tools.report_columns"):
        "a claim names a report column; the columns are the report's, read when a claim is checked",
    ("rlhf_lab.config.claims", "rlhf_lab.tools.report_exact"):
        "a claim's metric must be one its experiment logs: the exact task's columns are the report's",
    ("rlhf_lab.config.claims", "rlhf_lab.tools.claim_rule"):
        "the seeds a claim needs are the report's power calculation, checked before any job starts",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (at the top or inside a function), as their full names."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    # ``from rlhf_lab.x import y`` names both x and (if it is a module) x.y: keep the most specific module
    names = {n for n in found if n in known and n != name}
    return {n for n in names if not any(other.startswith(n + ".") for other in names)}


def layer(name: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def upward_imports() -> dict[tuple[str, str], tuple[int, int]]:
    mods = modules()
    known = set(mods)
    found = {}
    for name, path in mods.items():
        for target in imports(name, path, known):
            if layer(target) > layer(name):
                found[(name, target)] = (layer(name), layer(target))
    return found


def test_every_module_has_a_layer() -> None:
    assert [name for name in modules() if layer(name) < 0] == []


def test_no_import_runs_back_up_but_the_named_crossings() -> None:
    upward = upward_imports()
    unexplained = sorted(f"{a} (layer {upward[a, b][0]}) -> {b} (layer {upward[a, b][1]})"
                         for a, b in upward if (a, b) not in CROSSINGS)
    assert unexplained == []


def test_each_named_crossing_is_still_in_the_code() -> None:
    assert sorted(set(CROSSINGS) - set(upward_imports())) == []


def test_the_registry_is_a_leaf() -> None:
    mods = modules()
    assert imports("rlhf_lab.registry", mods["rlhf_lab.registry"], set(mods)) <= {"rlhf_lab.errors"}


def test_no_module_is_over_400_lines() -> None:
    long = {name: n for name, p in modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_an_upward_import_is_caught() -> None:
    """The check itself: a runtime module importing the run would be reported."""
    assert layer("rlhf_lab.runtime.precision") < layer("rlhf_lab.training.loop")
    assert layer("rlhf_lab.config.schema_run") < layer("rlhf_lab.hardware") < layer("rlhf_lab.config.validate")
