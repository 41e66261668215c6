"""`reward_model`: a trained scalar reward model as a reward.

The model is an ``AutoModelForSequenceClassification`` with ``num_labels=1`` saved with its tokenizer;
its single logit is the reward r(prompt, response). The training stage ``algorithm=reward_model``
(:mod:`rlhf_lab.offline.reward_trainer`) writes such a folder (``RUN/model``, with its pooling in the config);
training and scoring format the pair the same way (``format_prompt_response``), so it scores as it was trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf_lab.registry import register
from rlhf_lab.rewards.base import (
    ConfigLike,
    Reward,
    RewardOutput,
    ensure_pad_token,
    load_sequence_classifier,
    resolve_max_length,
    sequence_logits,
    tokenize,
)
from rlhf_lab.rewards.pooling import sequence_rewards


def uses_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt_response(tokenizer: Any, prompt: str, response: str) -> str:
    """The text a reward model reads: the chat template when the tokenizer has one, else prompt\\nresponse."""
    if uses_chat_template(tokenizer):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return prompt + "\n" + response


def _prepare(model: Any, tokenizer: Any) -> None:
    if model.config.num_labels != 1:
        raise ValueError(
            f"a reward model needs num_labels=1 (one scalar); this model has {model.config.num_labels}"
        )
    ensure_pad_token(model, tokenizer)
    # Truncate from the left: the end of the response matters more than the start of a long prompt.
    tokenizer.truncation_side = "left"


@register("reward", "reward_model")
class RewardModelReward(Reward):
    """Scalar reward model r(prompt, response): the single logit of a sequence-classification model.

    Config fields:
        model_path: folder with an ``AutoModelForSequenceClassification`` (``num_labels=1``) and its
            tokenizer, e.g. ``RUN/model`` of an ``algorithm=reward_model`` run. Required.
        normalize: standardise scores to (r − mean) / std, given either as a mapping
            ``normalize: {mean: 0.3, std: 1.2}`` or as ``normalize: true`` with the flat fields below.
        mean, std: used when ``normalize`` is true (defaults 0 and 1; ignored when it is false).
        batch_size: pairs per forward pass (default 32).
        max_length: truncation length in tokens, cutting from the left; capped at what the model accepts.

    The text is the tokenizer's chat template over (user: prompt, assistant: response) when it has one,
    else ``prompt + "\\n" + response``.
    """

    name = "reward_model"
    config_fields = ("model_path", "normalize", "mean", "std", "batch_size", "max_length")

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.model_path = self.option("model_path")
        if not self.model_path:
            raise ValueError("reward 'reward_model' needs model_path (RUN/model of an algorithm=reward_model run)")
        self.batch_size = int(self.option("batch_size", 32))
        if self.batch_size < 1:
            raise ValueError(f"reward.batch_size={self.batch_size} must be at least 1")
        self.model, self.tokenizer = load_sequence_classifier(self.model_path, self.device)
        _prepare(self.model, self.tokenizer)
        self.max_length = resolve_max_length(self.model, self.tokenizer, self.option("max_length"))
        self.mean, self.std = self._normalization()

    def _normalization(self) -> tuple[float, float]:
        normalize = self.option("normalize", False)
        if isinstance(normalize, Mapping):
            unknown = set(normalize) - {"mean", "std"}
            if unknown:
                raise ValueError(f"unknown normalize field(s) {sorted(unknown)}; valid fields: mean, std")
            mean, std = float(normalize.get("mean", 0.0)), float(normalize.get("std", 1.0))
        elif normalize is True:
            mean, std = float(self.option("mean", 0.0)), float(self.option("std", 1.0))
        elif normalize is False:
            mean, std = 0.0, 1.0
        else:
            raise ValueError(f"normalize must be true, false or a mapping {{mean, std}}; got {normalize!r}")
        if not std > 0:
            raise ValueError(f"reward_model normalize std must be > 0; got {std}")
        return mean, std

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        texts = [format_prompt_response(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        if getattr(self.model.config, "pooling", None):  # trained by algorithm=reward_model: its own pooling
            return RewardOutput(scores=(self._pooled_rewards(texts) - self.mean) / self.std)
        logits = sequence_logits(
            self.model,
            self.tokenizer,
            texts,
            self.batch_size,
            self.max_length,
            add_special_tokens=not uses_chat_template(self.tokenizer),
        )
        return RewardOutput(scores=(logits[:, 0] - self.mean) / self.std)


    @torch.no_grad()
    def _pooled_rewards(self, texts: list[str]) -> torch.Tensor:
        """Rewards [N] read with the pooling the model was trained with (``config.pooling``)."""
        pieces = []
        for start in range(0, len(texts), self.batch_size):
            inputs = tokenize(self.tokenizer, texts[start : start + self.batch_size], self.max_length, self.device,
                              add_special_tokens=not uses_chat_template(self.tokenizer))
            pieces.append(sequence_rewards(self.model, inputs["input_ids"], inputs["attention_mask"]).cpu())
        return torch.cat(pieces) if pieces else torch.zeros(0)
