"""``algorithm=reward_model``: a scalar reward model fit with the Bradley–Terry loss on preference pairs.

The model is ``AutoModelForSequenceClassification`` with one output on ``model=``'s causal LM (the embedded
SmolLM2 by default; ``model=tiny`` builds a tiny one in-process); the head reads the trunk's hidden state at
the last non-pad token (``algorithm.pooling=last``) or their mean (``mean``), and the choice is saved in
its config, so ``reward=reward_model reward.model_path=RUN/model`` scores exactly as training did.
A text is the chat template over (prompt messages, assistant: response), as ``reward=reward_model`` renders
it. The loop is :class:`rlhf_lab.offline.reward_trainer.RewardModelTrainer`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.offline.data import Example
from rlhf_lab.offline.losses import bradley_terry_loss
from rlhf_lab.offline.stage import OfflineStage
from rlhf_lab.registry import register
from rlhf_lab.rewards.pooling import POOLINGS, sequence_rewards
from rlhf_lab.rewards.reward_model import uses_chat_template

__all__ = ["POOLINGS", "RewardModelStage", "build_reward_model", "pair_texts", "reward_text"]


def reward_text(tokenizer: Any, prompt: list[dict[str, str]], response: str) -> str:
    """What the reward model reads: the chat template over the prompt and the response, else prompt\\nresponse
    (as :func:`rlhf_lab.rewards.reward_model.format_prompt_response` for a one-message prompt)."""
    if uses_chat_template(tokenizer):
        return tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
    return "\n".join(m["content"] for m in prompt) + "\n" + response


def pair_texts(tokenizer: Any, examples: list[Example]) -> list[str]:
    """The chosen texts, then the rejected ones: [2N]."""
    return ([reward_text(tokenizer, e.prompt, e.chosen) for e in examples]
            + [reward_text(tokenizer, e.prompt, e.rejected or "") for e in examples])


def build_reward_model(model_cfg: Any, tokenizer: Any, dtype: torch.dtype, seed: int) -> nn.Module:
    """A one-output sequence classifier on ``model_cfg``'s causal LM (the head newly initialised)."""
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

    from rlhf_lab.models.loading import apply_lora, smollm2_model_path, tiny_llama_config

    if model_cfg.name == "tiny" and not model_cfg.name_or_path:
        config = tiny_llama_config(tokenizer, model_cfg.tiny)
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForSequenceClassification(config)
    else:
        path = model_cfg.name_or_path or str(smollm2_model_path())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(dtype)
    if model_cfg.lora.enabled:
        model = apply_lora(model, model_cfg.lora, task_type="SEQ_CLS")
    return model


def tokenize_texts(tokenizer: Any, texts: list[str], max_length: int, device: torch.device) -> dict[str, Tensor]:
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt",
                      add_special_tokens=not uses_chat_template(tokenizer))
    return {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}


@register("algorithm", "reward_model")
class RewardModelStage(OfflineStage):
    """Bradley–Terry over pairs; the per-pair loss and metrics as pure functions of the pair's rewards."""

    pairs = True
    trainer = "rlhf_lab.offline.reward_trainer:RewardModelTrainer"

    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        return 2

    def rewards(self, model: nn.Module, tokenizer: Any, examples: list[Example],
                device: torch.device) -> tuple[Tensor, Tensor]:
        """(r_chosen, r_rejected) [N] each, with gradient when enabled."""
        inputs = tokenize_texts(tokenizer, pair_texts(tokenizer, examples), self.cfg.max_length, device)
        rewards = sequence_rewards(model, inputs["input_ids"], inputs["attention_mask"], self.cfg.pooling)
        return rewards[: len(examples)], rewards[len(examples) :]

    def pair_loss(self, chosen: Tensor, rejected: Tensor, examples: list[Example]) -> Tensor:
        """Per-pair Bradley–Terry loss [N], with the data's margins (``algorithm.use_margin``) and centring."""
        margin = None
        if self.cfg.use_margin and any(e.margin is not None for e in examples):
            margin = torch.tensor([e.margin or 0.0 for e in examples], dtype=chosen.dtype, device=chosen.device)
        return bradley_terry_loss(chosen, rejected, margin, self.cfg.center_rewards_coefficient)


def pair_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """Accuracy (r_w > r_l), mean margin r_w − r_l and mean reward over pairs."""
    return {"accuracy": float((chosen > rejected).float().mean()),
            "margin_mean": float((chosen - rejected).mean()),
            "reward_mean": float(torch.cat([chosen, rejected]).mean())}
