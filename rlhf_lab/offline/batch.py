"""Examples -> token rows in the rollout layout, so the online trainer's forward pass and updater train on them.

Each row is ``[left padding | prompt | response + EOS | right padding]`` (:class:`rlhf_lab.generation.rollout.Rollout`):
the prompt rendered exactly as generation renders it (the chat template with a generation prompt), the
response tokens followed by the tokenizer's EOS, which ``response_mask`` covers: the model learns to stop
(the EOS is the pad token in SmolLM2, so masks come from lengths, never from ``token == pad``). A response
cut at ``data.max_response_tokens`` carries no EOS. Prompts longer than ``data.max_prompt_tokens`` keep
their last tokens. With ``algorithm.packing`` demonstrations are packed into rows instead
(:mod:`rlhf_lab.offline.packing`), tokenized and cut by the same rules.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.offline.data import Example
from rlhf_lab.offline.packing import PackedRows, pack_documents, resolve_length


def render_prompt(messages: list[dict[str, str]], tokenizer: Any, chat_template: bool,
                  system_prompt: str | None) -> str:
    """The prompt text the model reads before its response (as :func:`rlhf_lab.generation.rollout.format_prompts`)."""
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return "\n".join(m["content"] for m in messages)
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def response_tokens(tokenizer: Any, response: str, max_tokens: int) -> list[int]:
    """The response's token ids and EOS; cut to ``max_tokens`` (no EOS then)."""
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if len(ids) + 1 > max_tokens:
        return ids[:max_tokens]
    return [*ids, tokenizer.eos_token_id]


def build_rows(prompt_ids: list[list[int]], responses: list[list[int]], pad_token_id: int,
               group_size: int) -> Rollout:
    """A :class:`Rollout` of the given rows: prompts left-padded to one width, responses right-padded."""
    prompt_width = max(len(p) for p in prompt_ids)
    response_width = max(1, max(len(r) for r in responses))
    rows = len(prompt_ids)
    input_ids = torch.full((rows, prompt_width + response_width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(rows, response_width)
    for row, (prompt, response) in enumerate(zip(prompt_ids, responses)):
        input_ids[row, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        if response:
            input_ids[row, prompt_width : prompt_width + len(response)] = torch.tensor(response, dtype=torch.long)
            response_mask[row, : len(response)] = 1.0
    zeros = torch.zeros(rows, response_width)
    return Rollout(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                   prompt_width=prompt_width, group_size=group_size, logprobs=zeros, entropy=zeros.clone())


class Collator:
    """Tokenizes examples for a model config and data config (prompt rendering, lengths)."""

    def __init__(self, tokenizer: Any, model_cfg: Any, data_cfg: Any) -> None:
        self.tokenizer, self.model_cfg, self.data_cfg = tokenizer, model_cfg, data_cfg
        self._prompts: dict[str, list[int]] = {}

    def prompt_ids(self, example: Example) -> list[int]:
        text = render_prompt(example.prompt, self.tokenizer, self.model_cfg.chat_template,
                             self.model_cfg.system_prompt)
        if text not in self._prompts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._prompts[text] = ids[-self.data_cfg.max_prompt_tokens :]
        return self._prompts[text]

    def response_ids(self, response: str) -> list[int]:
        return response_tokens(self.tokenizer, response, self.data_cfg.max_response_tokens)

    def demonstrations(self, examples: list[Example]) -> Rollout:
        """One row per demonstration (group size 1)."""
        return build_rows([self.prompt_ids(e) for e in examples], [self.response_ids(e.chosen) for e in examples],
                          self.tokenizer.pad_token_id, 1)

    def packed_demonstrations(self, examples: list[Example], packing_length: int | None) -> PackedRows:
        """The demonstrations packed into rows of ``packing_length`` tokens (null: the longest unpacked row).

        A demonstration longer than a row is cut as unpacked ones are: its prompt keeps its last tokens (at
        most a row's length − 1), its response what room is left (no EOS when cut).
        """
        length = resolve_length(packing_length, self.data_cfg)
        documents = []
        for example in examples:
            prompt = self.prompt_ids(example)[-(length - 1) :]
            room = min(self.data_cfg.max_response_tokens, length - len(prompt))
            documents.append((prompt, response_tokens(self.tokenizer, example.chosen, room)))
        return pack_documents(documents, length, self.tokenizer.pad_token_id)

    def pairs(self, examples: list[Example]) -> Rollout:
        """Two rows per pair, chosen then rejected (group size 2: rows 2i and 2i + 1 share a prompt)."""
        prompts, responses = [], []
        for example in examples:
            prompt = self.prompt_ids(example)
            prompts += [prompt, prompt]
            responses += [self.response_ids(example.chosen), self.response_ids(example.rejected or "")]
        return build_rows(prompts, responses, self.tokenizer.pad_token_id, 2)
