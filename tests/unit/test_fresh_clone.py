"""The README's test command on a fresh clone: ``make test`` needs no optional extra, CI runs it before installing
any, and every test that needs an extra says so with a marker (skipped with the install command where it is absent,
run by ``make test-extras``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXTRAS
from tests.limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
# The optional packages' top-level modules (the extras' own and what they alone bring).
OPTIONAL_MODULES = ["vllm", "reasoning_gym", "mlflow", "ray", "trl", "verifiers", "openai", "trackio"]


def make_target(name: str) -> tuple[list[str], list[str]]:
    """A Makefile target's prerequisites and recipe lines."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(name)}:([^\n]*)\n((?:\t[^\n]*\n)*)", text, flags=re.MULTILINE)
    assert match, f"no target {name} in the Makefile"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_ci_runs_the_readme_s_test_command_before_any_extra_is_installed() -> None:
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    makes = [line for line in commands if line.startswith("make ")]
    assert makes[0] == "make test", commands  # the newcomer's command, first, with nothing else installed
    assert not any(re.search(r"\b(pip|install|uv)\b", line) for line in commands[:commands.index("make test")])
    assert "make test-extras" in makes[1:]
    assert "make test" in (ROOT / "README.md").read_text()
    prerequisites, recipe = make_target("test")
    assert prerequisites == ["install"]  # the base install only
    assert recipe == ["$(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)"]


def test_every_extra_has_its_install_target_and_test_extras_installs_them_all() -> None:
    prerequisites, _ = make_target("install-extras")
    assert make_target("test-extras")[0] == ["install-extras"]
    for name, (_, install) in EXTRAS.items():
        target = install.split(",")[0].removeprefix("make ")
        assert target in prerequisites, (name, target)
        make_target(target)  # exists


COUNTER = """
import collections, json, sys
class Count:
    def pytest_collection_modifyitems(self, items):
        counts = collections.Counter(m.args[0] for item in items for m in item.iter_markers("extra"))
        print("extras:", json.dumps(counts))
"""


@pytest.fixture(scope="module")
def collection() -> subprocess.CompletedProcess:
    """The whole suite collected in a process where every optional package fails to import, as on a fresh clone; it
    prints how many tests need each extra."""
    # None in sys.modules: ``import NAME`` raises ModuleNotFoundError and ``importlib.util.find_spec(NAME)`` is None,
    # as where the package is not installed.
    blocked = [*OPTIONAL_MODULES, "hydra_plugins.hydra_ray_launcher"]
    script = (f"{COUNTER}\nsys.modules.update(dict.fromkeys({blocked!r}))\nimport pytest\n"
              "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', 'tests'], "
              "plugins=[Count()]))")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def test_no_test_module_imports_an_optional_package_at_collection(collection) -> None:
    assert collection.returncode == 0, collection.stdout[-3000:] + collection.stderr[-3000:]
    assert re.search(r"^\d+ tests collected", collection.stdout, flags=re.MULTILINE), collection.stdout[-1000:]
    assert "error" not in collection.stdout.splitlines()[-1].lower()


def test_the_readme_counts_the_tests_each_extra_skips(collection) -> None:
    counts = json.loads(re.search(r"^extras: (.*)$", collection.stdout, flags=re.MULTILINE).group(1))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert set(counts) == set(EXTRAS)
    assert f"the {sum(counts.values())} tests that do are skipped" in readme
    named = {"vllm": "vLLM", "verifiers": "verifiers", "reasoning": "reasoning-gym", "ray": "Ray", "trl": "TRL",
             "mlflow": "MLflow", "openai": "openai", "trackio": "trackio"}
    listed = dict(re.findall(r"(vLLM|verifiers|reasoning-gym|Ray|TRL|MLflow|openai|trackio) (\d+)", readme))
    assert {name: int(listed[named[name]]) for name in counts} == counts
