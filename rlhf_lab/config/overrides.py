"""Python values written back as Hydra override text (a leaf: imports only Hydra's parser, lazily)."""

from __future__ import annotations

from typing import Any


def override_text(value: Any) -> str:
    """``value`` as override text that Hydra reads back as the same value: ``null``, ``true``/``false``, numbers
    in full precision, a plain word or number as itself, anything else single-quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_override(f"k={text}")
        if not parsed.is_sweep_override() and parsed.get_value_element_as_str() == text:
            return text
    except Exception:  # not a plain value: quote it
        pass
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b": value}``; lists stay values."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return flat


def normalize_overrides(overrides: list[str]) -> list[str]:
    """``+experiment=NAME`` -> ``experiment=NAME``: the root defaults list has ``experiment: null``, which
    Hydra overrides without ``+`` and refuses to append to; both spellings select the experiment."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]
