"""Shell completion (``rlhf-lab -sc install=bash``, then ``rlhf-lab algorithm=<TAB>``): Hydra's own, without the
structured-config schemas. The schemas (``algorithm=grpo_schema``, ...) live in the same groups of Hydra's
ConfigStore as the options, because each option's YAML file builds on one; they are not options to pick."""

from __future__ import annotations

from typing import Any

from rlhf_lab.config.sweep_jobs import is_schema


def offered(candidates: list[str]) -> list[str]:
    """The completion candidates (``group=option``, ``group/``, ``key=``) without the schemas."""
    return [word for word in candidates if not is_schema(word.rsplit("=", 1)[-1].rsplit("/", 1)[-1])]


def hide_schemas() -> None:
    """Make Hydra's completion plugins (bash, zsh, fish) leave the schemas out of the group options they offer."""
    from hydra.plugins.completion_plugin import CompletionPlugin

    listed = CompletionPlugin._query_config_groups
    if getattr(listed, "hides_schemas", False):
        return

    def without_schemas(self: Any, word: str, config_name: str | None, words: list[str]) -> tuple[list[str], bool]:
        matched, exact = listed(self, word, config_name, words)
        return offered(matched), exact

    without_schemas.hides_schemas = True  # type: ignore[attr-defined]
    CompletionPlugin._query_config_groups = without_schemas  # type: ignore[method-assign]
