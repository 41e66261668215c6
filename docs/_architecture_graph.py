"""The picture of rlhf_lab's parts in docs/concepts/architecture.md, drawn from the package's imports.

    python docs/_architecture_graph.py            # rewrite the picture and its table between their markers
    python docs/_architecture_graph.py --check    # exit 1 when the page's picture is not the code's

A part is a folder of the package (``training``, ``kl``, ...) or a module of its top folder (``registry``,
``errors``, ...). An arrow ``A --> B`` says a module of A imports one of B when it loads; a dotted arrow
``A -.-> B`` says the import is inside a function (it runs when the function is called, the way a command loads
its parts on first use). Imports under ``if TYPE_CHECKING:`` never run and are left out. The table beside the
picture gives each part's size and the same imports as lists. tests/unit/test_architecture_graph.py checks that
the page holds exactly what this script draws, so the picture cannot go stale.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = REPOSITORY / "rlhf_lab"
PAGE = REPOSITORY / "docs" / "concepts" / "architecture.md"
START, END = "<!-- import-graph:start (python docs/_architecture_graph.py) -->", "<!-- import-graph:end -->"


@dataclass
class Part:
    """One part of the package: its modules' lines and the parts it imports, at load and inside functions."""

    files: int = 0
    lines: int = 0
    at_load: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)


def part_of(module: str, package: Path) -> str | None:
    """The part a dotted module name of the package belongs to (``rlhf_lab.kl.exact`` -> ``kl``)."""
    names = module.split(".")
    if names[0] != package.name:
        return None
    if len(names) == 1:
        return "__init__"
    return names[1]


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, at load) for each import of a module's tree; relative imports resolved against ``module``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, not in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")[: len(module.split(".")) - child.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, *([base] if base else [])])
                if "." in base:  # `from rlhf_lab.kl import exact`: rlhf_lab.kl loads too (never just the top package)
                    found.append((base, not in_function))
                found.extend((f"{base}.{alias.name}", not in_function) for alias in child.names)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree, False)
    return found


def parts(package: Path = PACKAGE) -> dict[str, Part]:
    """Every part of ``package`` with its size and the other parts it imports."""
    found: dict[str, Part] = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        name = relative.stem if len(relative.parts) == 1 else relative.parts[0]  # a top-folder module, or a folder
        is_package = relative.name == "__init__.py"
        module = ".".join([package.name, *relative.with_suffix("").parts[: -1 if is_package else None]])
        part = found.setdefault(name, Part())
        text = path.read_text(encoding="utf-8")
        part.files += 1
        part.lines += len(text.splitlines())
        for imported, at_load in _imports(ast.parse(text), module, is_package):
            target = part_of(imported, package)
            if target is not None and not ((package / target).is_dir() or (package / f"{target}.py").is_file()):
                target = "__init__"  # `from rlhf_lab import compose`: a name of the package's __init__
            if target is not None and target != name:
                (part.at_load if at_load else part.deferred).add(target)
    for part in found.values():
        part.deferred -= part.at_load
    return found


def mermaid(found: dict[str, Part]) -> str:
    """The parts and their imports as a mermaid flowchart (solid: at load; dotted: inside a function)."""
    lines = ["```mermaid", "flowchart LR"]
    for name in sorted(found):
        for target in sorted(found[name].at_load):
            lines.append(f"  {_node(name)} --> {_node(target)}")
        for target in sorted(found[name].deferred):
            lines.append(f"  {_node(name)} -.-> {_node(target)}")
    lines.append("```")
    return "\n".join(lines)


def _node(name: str) -> str:
    return "init[__init__]" if name == "__init__" else "main[__main__]" if name == "__main__" else name


def table(found: dict[str, Part]) -> str:
    """Each part's files, lines and imports, largest first."""
    rows = ["| part | files | lines | imports when it loads | imports inside functions |", "| --- | --- | --- | --- | --- |"]
    for name in sorted(found, key=lambda n: (-found[n].lines, n)):
        part = found[name]
        rows.append(f"| `{name}` | {part.files} | {part.lines} | {', '.join(sorted(part.at_load)) or '—'} | "
                    f"{', '.join(sorted(part.deferred)) or '—'} |")
    return "\n".join(rows)


def block(package: Path = PACKAGE) -> str:
    """What the page holds between its markers."""
    found = parts(package)
    return f"{START}\n{mermaid(found)}\n\n{table(found)}\n{END}"


def page_block(page: Path = PAGE) -> str:
    """The block the page holds now (markers included)."""
    text = page.read_text(encoding="utf-8")
    return text[text.index(START): text.index(END) + len(END)]


def main(args: list[str]) -> int:
    text, drawn = PAGE.read_text(encoding="utf-8"), block()
    if "--check" in args:
        if page_block() != drawn:
            print(f"{PAGE.relative_to(REPOSITORY)}: the picture is stale; run python docs/_architecture_graph.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text.replace(page_block(), drawn), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
