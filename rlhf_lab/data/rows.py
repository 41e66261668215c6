"""A prompt with the data row it came from: conversational prompts and the columns rewards read.

Prompt sets come as users bring them (TRL's formats): a ``prompt`` column of text, or of messages
(``[{"role": "system", ...}, {"role": "user", ...}]``, the conversational format), and any other columns (a ground
truth ``answer``, a task's metadata). A :class:`Prompt` is the prompt's text, so everything that handles prompts as
text (batching, the sample tables, logs) keeps working, and it carries the row: ``messages``, rendered through the
chat template as they are (system messages included), and ``columns``, passed to every reward that reads them as
keyword arguments, one list per column (as TRL passes dataset columns to reward functions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class Prompt(str):
    """The prompt's text (a conversation's messages as ``role: content`` lines) with its row (see the module)."""

    messages: tuple[dict[str, str], ...] | None
    columns: dict[str, Any]
    origin: str | None  # where its row is ("row 3 of data/train.jsonl"), for errors that name it

    def __new__(cls, text: str, messages: Sequence[dict[str, str]] | None = None,
                columns: dict[str, Any] | None = None, origin: str | None = None) -> Prompt:
        prompt = super().__new__(cls, text)
        prompt.messages = tuple(dict(m) for m in messages) if messages is not None else None
        prompt.columns = dict(columns or {})
        prompt.origin = origin
        return prompt

    def __reduce__(self) -> tuple[Any, ...]:
        return Prompt, (str(self), self.messages, self.columns, self.origin)


def conversation_text(messages: Sequence[dict[str, str]]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def messages_problem(value: Any) -> str | None:
    """Why ``value`` is not a conversation (a non-empty list of ``{"role", "content"}`` with known roles), or None."""
    if not isinstance(value, list) or not value:
        return "not a non-empty list of messages"
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"message {index} is not {{'role': ..., 'content': '...'}}"
        if message.get("role") not in ROLES:
            return f"message {index} has role {message.get('role')!r}; roles: {', '.join(ROLES)}"
    return None


def make_prompt(value: str | list[dict[str, str]], columns: dict[str, Any], origin: str | None = None) -> Prompt:
    """A row's prompt: text as it is, or a conversation (checked with :func:`messages_problem` first)."""
    if isinstance(value, str):
        return Prompt(value, columns=columns, origin=origin)
    messages = [{"role": m["role"], "content": m["content"]} for m in value]
    return Prompt(conversation_text(messages), messages, columns, origin)


def origin_of(prompt: str) -> str:
    """How an error names a prompt: its row and file where known, and its opening words."""
    where = getattr(prompt, "origin", None)
    return (f"{where}, " if where else "") + f"prompt {str(prompt)[:40]!r}"


def columns_of(prompts: Sequence[str]) -> dict[str, list[Any]]:
    """Every column of the prompts' rows, one list per column (None where a row lacks it); {} for plain text."""
    names = sorted({name for p in prompts for name in getattr(p, "columns", {})})
    return {name: [getattr(p, "columns", {}).get(name) for p in prompts] for name in names}
