"""The picture of the package's parts in docs/concepts/architecture.md is what docs/_architecture_graph.py draws from
the imports today, and the script reads imports as Python runs them."""

from __future__ import annotations

from pathlib import Path

from scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "_architecture_graph.py"
graph = load_script(SCRIPT, "architecture_graph")


def test_the_page_holds_the_picture_the_code_draws() -> None:
    assert graph.page_block() == graph.block(), "stale picture: run python docs/_architecture_graph.py"
    assert "  training --> kl" in graph.page_block() and "| `registry` | 1 |" in graph.page_block()


def test_imports_at_load_inside_functions_relative_and_type_only(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for folder in ("a", "b"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("def compose():\n    from pkg.a.x import run\n")
    (package / "c.py").write_text("import pkg.b.y\n")
    (package / "a" / "x.py").write_text(
        "from pkg.b.y import thing\nfrom . import z\n\ndef run():\n    from pkg import c, compose\n")
    (package / "a" / "z.py").write_text("from ..b import y\n")
    (package / "b" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\nelse:\n    import pkg.c\n")
    found = graph.parts(package)
    assert set(found) == {"__init__", "a", "b", "c"}
    assert (found["a"].at_load, found["a"].deferred) == ({"b"}, {"c", "__init__"})
    assert (found["b"].at_load, found["b"].deferred) == ({"c"}, set())  # the TYPE_CHECKING import never runs
    assert (found["c"].at_load, found["__init__"].deferred) == ({"b"}, {"a"})
    assert (found["a"].files, found["a"].lines) == (3, 6)
    drawn = graph.mermaid(found)
    assert "  a --> b\n" in drawn and "  a -.-> init[__init__]\n" in drawn and "  init[__init__] -.-> a\n" in drawn
