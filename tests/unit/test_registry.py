"""registry: a leaf that holds components by kind and name; unknown names list the registered ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlhf_lab.components  # noqa: F401
from rlhf_lab import registry
from rlhf_lab.errors import RegistryError, UserError

PACKAGE = Path(registry.__file__).resolve().parent


def test_registry_imports_nothing_of_the_package_but_its_error_type() -> None:
    tree = ast.parse(Path(registry.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name and name.startswith("rlhf_lab")} == {"rlhf_lab.errors"}


def test_builtins_are_registered_once_components_is_imported() -> None:
    assert {"cispo", "dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce", "reinforce_pp", "remax",
            "rloo"} <= set(registry.names("algorithm"))
    assert registry.names("advantage") == ["dr_grpo", "gae", "grpo", "reinforce", "reinforce_pp",
                                           "reinforce_pp_baseline", "remax", "rloo"]
    assert registry.names("policy_loss") == ["cispo", "clip", "dppo", "gspo", "reinforce"]
    assert registry.names("kl") == ["abs", "full", "k1_plus", "k3", "k3_plus", "kl", "mse", "none", "sequence_full",
                                    "sequence_k1"]
    assert registry.names("kl_placement") == ["loss", "reward"]
    assert registry.names("loss_aggregation") == ["sequence_mean", "sequence_sum_constant", "token_mean"]
    assert registry.names("baseline") == ["batch_mean", "loo", "none"]
    assert registry.names("logger") == ["csv", "mlflow", "none", "tensorboard", "trackio", "wandb"]


def test_unknown_name_and_kind_are_one_line_user_errors() -> None:
    with pytest.raises(RegistryError) as raised:
        registry.get("kl", "k4")
    assert str(raised.value) == ("unknown kl 'k4'; registered: abs, full, k1_plus, k3, k3_plus, kl, mse, none, "
                                 "sequence_full, sequence_k1")
    assert isinstance(raised.value, UserError)
    with pytest.raises(RegistryError, match="^unknown component kind 'klx'; valid kinds: "):
        registry.get("klx", "k3")


def test_register_returns_the_object_and_refuses_a_second_owner() -> None:
    def estimator(logprobs, ref_logprobs, logits=None, ref_logits=None):
        return logprobs - ref_logprobs

    try:
        assert registry.register("kl", "test_only_estimator")(estimator) is estimator
        assert registry.get("kl", "test_only_estimator") is estimator
        registry.register("kl", "test_only_estimator")(estimator)  # the same object again: fine
        with pytest.raises(ValueError, match="already registered"):
            registry.register("kl", "test_only_estimator")(lambda *a, **k: None)
    finally:
        registry._REGISTRY["kl"].pop("test_only_estimator", None)


def test_no_import_circles_in_the_package() -> None:
    """Static import graph of rlhf_lab (every import statement, function-level ones too) has no cycle."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        return found

    graph = {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ importing its own children is not a circle; drop those edges.
    graph = {name: {m for m in deps if not m.startswith(name + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*stack[stack.index(dep):], dep])}")
            if dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
