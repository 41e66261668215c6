"""`classifier`: one label's logit or probability from any sequence-classification model."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lab.registry import register
from rlhf_lab.rewards.base import (
    ConfigLike,
    Reward,
    RewardOutput,
    load_sequence_classifier,
    resolve_max_length,
    sequence_logits,
)

OUTPUTS = ("logit", "probability")


@register("reward", "classifier")
class ClassifierReward(Reward):
    """Score responses with an ``AutoModelForSequenceClassification`` (a local folder or a hub id).

    Config fields:
        model_path: folder or hub id of the classifier (and its tokenizer). Required.
        label: which output to reward: a label name from ``config.id2label`` or an integer index
            (default: index 0, which is also the only label of a one-label model).
        output: ``logit`` (default) or ``probability`` (softmax over labels; sigmoid for one label).
        include_prompt: score ``prompt + separator + response`` instead of the response (default False).
        separator: text placed between prompt and response when ``include_prompt`` (default ``" "``).
        batch_size: texts per forward pass (default 32).
        max_length: truncation length in tokens, capped at what the tokenizer and model accept.
    """

    name = "classifier"
    config_fields = (
        "model_path",
        "label",
        "output",
        "include_prompt",
        "separator",
        "batch_size",
        "max_length",
    )

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.model_path = self.option("model_path")
        if not self.model_path:
            raise ValueError("reward 'classifier' needs model_path (a sequence-classification model)")
        self.output = self.option("output", "logit")
        if self.output not in OUTPUTS:
            raise ValueError(
                f"unknown classifier output {self.output!r}; valid outputs: {', '.join(OUTPUTS)}"
            )
        self.include_prompt = bool(self.option("include_prompt", False))
        self.separator = self.option("separator", " ")
        self.batch_size = int(self.option("batch_size", 32))
        if self.batch_size < 1:
            raise ValueError(f"reward.batch_size={self.batch_size} must be at least 1")
        self.model, self.tokenizer = load_sequence_classifier(self.model_path, self.device)
        self.max_length = resolve_max_length(self.model, self.tokenizer, self.option("max_length"))
        self.label_index = resolve_label(self.option("label", 0), self.model.config, self.model_path)

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        texts = (
            [p + self.separator + r for p, r in zip(prompts, responses)] if self.include_prompt else responses
        )
        logits = sequence_logits(self.model, self.tokenizer, texts, self.batch_size, self.max_length)
        if self.output == "probability":
            logits = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
        return RewardOutput(scores=logits[:, self.label_index].contiguous())


def resolve_label(label: Any, model_config: Any, model_path: str) -> int:
    """Index of ``label`` (a name in ``id2label`` or an int index); unknown labels list the model's labels."""
    num_labels = model_config.num_labels
    id2label = {int(index): str(name) for index, name in (model_config.id2label or {}).items()}
    labels = ", ".join(f"{index}={id2label.get(index, index)}" for index in range(num_labels))
    if isinstance(label, int) and not isinstance(label, bool):
        if 0 <= label < num_labels:
            return label
    elif isinstance(label, str):
        for index, name in id2label.items():
            if name == label and index < num_labels:
                return index
    raise ValueError(f"unknown label {label!r} for classifier {model_path!r}; its labels: {labels}")
