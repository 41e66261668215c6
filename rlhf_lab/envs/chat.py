"""Messages to token ids without re-rendering: the first prompt through the chat template, every later message as
the tokens it adds.

A multi-turn trajectory is the prompt's ids, the sampled ids of each model turn and the ids of the environment's
messages, concatenated as they were produced. Rendering the whole conversation again afterwards is not the same
thing: a template may rewrite earlier turns (drop a reasoning block, reformat a tool call) and a tokenizer may
merge differently across a boundary, so the trained tokens would not be the sampled ones. So the environment's
messages are tokenised on their own, as the template renders them after an assistant turn: the template is
applied to a fixed conversation that ends with an assistant message (``_BASE``) and to the same with the new
messages and the generation prompt after it; the new messages' ids are what follows the base's last end-of-turn
token (the token the model's own turn ended with). Without a chat template (``model.chat_template=false``, or a
tokenizer that has none) each message's content is tokenised as it is.
"""

from __future__ import annotations

import json
from typing import Any

from rlhf_lab.envs.base import Message

_BASE: list[Message] = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]


class ChatFormat:
    """How the episodes' messages become token ids for ``tokenizer`` (see the module's text)."""

    def __init__(self, tokenizer: Any, chat_template: bool, system_prompt: str | None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(chat_template and getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.tools = tools or None
        self._base_prefix: list[int] | None = None
        self._tools_rendered: bool | None = None  # whether the template renders tools= (checked once)

    def _render(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The episode's first prompt: its messages (after ``model.system_prompt``, where they have no system
        message) with the generation prompt. A template that ignores ``tools=`` (SmolLM2's) gets the tools in its
        system message instead, in the Hermes format the calls are parsed in."""
        if not self.templated:
            return self._plain(messages)
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if self.tools and not self._takes_tools():
            messages = with_tools_in_system(messages, self.tools)
        return self._render(messages, generation_prompt=True)

    def _takes_tools(self) -> bool:
        """Whether the template renders ``tools=`` at all (two renderings, once per format, not per episode)."""
        if self._tools_rendered is None:
            plain = self.tokenizer.apply_chat_template(_BASE[:1], tokenize=False, add_generation_prompt=True)
            self._tools_rendered = plain != self.tokenizer.apply_chat_template(
                _BASE[:1], tools=self.tools, tokenize=False, add_generation_prompt=True)
        return self._tools_rendered

    def continuation_ids(self, messages: list[Message]) -> list[int]:
        """The ids the environment's ``messages`` add after a model turn, the next generation prompt included."""
        if not self.templated:
            return self._plain(messages)
        prefix = self._prefix()
        full = self._render([*_BASE, *messages], generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders a conversation's earlier turns differently once more "
                             "messages follow, so the environment's messages cannot be tokenised on their own")
        return full[len(prefix) :]

    def _prefix(self) -> list[int]:
        """The base conversation's ids up to and including its last end-of-turn token."""
        if self._base_prefix is None:
            base = self._render(_BASE, generation_prompt=False)
            end = self.tokenizer.eos_token_id
            last = max((i for i, token in enumerate(base) if token == end), default=len(base) - 1)
            self._base_prefix = base[: last + 1]
        return self._base_prefix

    def _plain(self, messages: list[Message]) -> list[int]:
        text = " ".join(m["content"] for m in messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def assistant_text(self, ids: list[int]) -> str:
        """A model turn's sampled ids as the message the environment reads (special tokens dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


TOOLS_TEXT = ("You can call these tools:\n<tools>\n{tools}\n</tools>\nTo call one, write <tool_call>{{\"name\": "
              "\"...\", \"arguments\": {{...}}}}</tool_call>; its result comes back in the next message.")


def with_tools_in_system(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """The messages with the tools' schemas described in the system message (added, or appended to the first)."""
    text = TOOLS_TEXT.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
