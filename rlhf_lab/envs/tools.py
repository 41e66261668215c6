"""Python functions as tools: their JSON schemas for the chat template, the model's calls parsed in the
tokenizer's own format, and the results as tool messages.

A tool is a plain function with type hints and a Google-style docstring (``Args:``); transformers'
``get_json_schema`` turns it into the schema ``apply_chat_template(tools=...)`` takes. The model's calls are
parsed by the tokenizer's own response schema where it has one (``tokenizer.parse_response``), else from the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that Hermes-style templates (Qwen2.5,
SmolLM3, ...) ask the model to write. A call that cannot be parsed, names an unknown tool, has bad arguments or
raises becomes a tool message saying so (the model reads it next turn), never a crash of the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lab.envs.base import Environment, EnvState, Message, StepResult

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_schemas(tools: tuple[Callable[..., Any], ...] | list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, from its signature and docstring (transformers' ``get_json_schema``)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tool) for tool in tools]


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or why it could not be read."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str, tokenizer: Any = None) -> list[ToolCall]:
    """The tool calls in an assistant message (none: the model answered)."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text)
        return [_call(call.get("function", call)) for call in parsed.get("tool_calls") or []]
    calls = []
    for body in _CALL.findall(text):
        try:
            calls.append(_call(json.loads(body)))
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, {}, f"the tool call is not JSON ({error.msg}): {body[:80]!r}"))
    return calls


def _call(value: Any) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, {}, f"a tool call needs a 'name' and 'arguments', got {str(value)[:80]!r}")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some formats write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(value["name"], {}, f"the arguments of {value['name']!r} are not JSON: {arguments[:80]!r}")
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, f"the arguments of {value['name']!r} are not an object: {arguments!r}")
    return ToolCall(value["name"], arguments)


def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable[..., Any]]) -> tuple[list[Message], int]:
    """Each call's result as a tool message, in order; returns (messages, number of calls that failed)."""
    messages, errors = [], 0
    for call in calls:
        content, failed = _result(call, tools)
        errors += failed
        messages.append({"role": "tool", "name": call.name or "unknown", "content": content})
    return messages, errors


def _result(call: ToolCall, tools: dict[str, Callable[..., Any]]) -> tuple[str, bool]:
    if call.error is not None:
        return f"Error: {call.error}", True
    if call.name not in tools:
        return f"Error: no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", True
    try:
        return str(tools[call.name](**call.arguments)), False
    except Exception as error:  # a tool's failure is the model's to read, not the run's to die of
        return f"Error: {type(error).__name__}: {error}", True


class ToolEnvironment(Environment):
    """An environment whose model may call ``tools`` before it answers: a turn with tool calls gets their results
    as tool messages (reward 0, the episode goes on); a turn without is the answer, scored by :meth:`answer`.
    Every step reports ``tool_calls`` and ``tool_errors`` (logged as ``env/tool_calls``, ``env/tool_errors``)."""

    def step(self, assistant_message: str, state: EnvState) -> StepResult:
        calls = parse_tool_calls(assistant_message, getattr(self, "tokenizer", None))
        if calls:
            messages, errors = run_tool_calls(calls, {tool.__name__: tool for tool in self.tools})
            return StepResult(messages, 0.0, False, {"tool_calls": float(len(calls)), "tool_errors": float(errors)})
        result = self.answer(assistant_message, state)
        result.info = {"tool_calls": 0.0, "tool_errors": 0.0, **result.info}
        return result

    def answer(self, assistant_message: str, state: EnvState) -> StepResult:
        raise NotImplementedError
