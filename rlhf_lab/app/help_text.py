"""``--help`` in plain text: a module docstring's reStructuredText markup (````code````, ``:mod:`x```) as a terminal
shows it."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|ref):`~?([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST roles and literal markup: ``:mod:`rlhf_lab.x``` -> rlhf_lab.x, ````a=b```` -> a=b."""
    return ROLE.sub(r"\1", text).replace("``", "")
