"""A Griffe extension for the docs build: the project's reStructuredText habits, rendered as Markdown.

rlhf_lab's docstrings are prose with a few reStructuredText constructs that Markdown shows verbatim:

- roles such as ``:func:`~rlhf_lab.kl.estimate``` become inline code (``estimate``; a leading ``~`` keeps
  the last part only, an explicit ``title <target>`` keeps the title);
- a paragraph ending in ``::`` before a literal block ends in ``:`` (the block is indented, so Markdown
  already shows it as code);
- a simple table (rows between ``====  ====`` rules) becomes a Markdown table.

Only the rendered text changes; the source is not touched. Loaded by mkdocs.yml (mkdocstrings' ``extensions``).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|data|attr|exc|obj|const|type):`(?P<body>[^`]+)`")
RULE = re.compile(r"^(=+)(\s+=+)+\s*$")


def _role_text(match: re.Match[str]) -> str:
    body = match.group("body").strip()
    titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    if titled:
        return f"`{titled.group('title')}`"
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return f"`{body}`"


def _columns(rule: str) -> list[tuple[int, int]]:
    """Start and end of each ``=====`` run of a table rule."""
    return [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]


def _split_row(line: str, spans: list[tuple[int, int]]) -> list[str]:
    cells = []
    for index, (start, _) in enumerate(spans):
        end = spans[index + 1][0] if index + 1 < len(spans) else len(line)
        cells.append(line[start:end].strip())
    return cells


def _tables(lines: list[str]) -> list[str]:
    """Header-less simple tables (rule, rows, rule) as Markdown tables (with an empty header row)."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if RULE.match(line):
            end = next((j for j in range(index + 1, len(lines)) if RULE.match(lines[j])), None)
            if end is not None:
                spans = _columns(line)
                rows = [_split_row(row, spans) for row in lines[index + 1 : end] if row.strip()]
                if rows:
                    out.append("|" + "   |" * len(spans))
                    out.append("|" + " --- |" * len(spans))
                    out.extend("| " + " | ".join(cells) + " |" for cells in rows)
                    index = end + 1
                    continue
        out.append(line)
        index += 1
    return out


def _literal_markers(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        stripped = line.rstrip()
        if stripped.endswith("::") and not stripped.endswith(":::"):
            text = stripped[:-2].rstrip()
            line = f"{text}:" if text else ""
        out.append(line)
    return out


def markdown(text: str) -> str:
    """The docstring ``text`` with the constructs above turned into Markdown."""
    text = ROLE.sub(_role_text, text)
    lines = _tables(text.splitlines())
    return "\n".join(_literal_markers(lines))


class RstToMarkdown(Extension):
    """Rewrite every loaded object's docstring (see the module's text)."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
