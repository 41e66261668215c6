"""What every reward shares: the output type, config access, and the registry entry point.

A reward is a class registered with ``@register("reward", NAME)``, built as ``RewardClass(cfg,
device="cpu")`` and called on a batch::

    reward = build_reward({"name": "sentiment", "target": "positive"})
    out = reward(prompts, responses)   # out.scores: float32 [N]; out.components: {key: [N]}

``cfg`` is an OmegaConf ``DictConfig`` or a plain dict. A reward reads the fields it lists in
``config_fields`` and ignores others, so one structured config holding every reward's fields works for
all of them (OmegaConf catches typos there). Composite components are free-form mappings, so
``composite`` checks each one with ``check_config_fields``. Scores always come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lab.registry import get

ConfigLike = Mapping[str, Any] | DictConfig


@dataclass
class RewardOutput:
    """Per-sample rewards: ``scores`` float32 [N]; ``components`` named parts, each [N] (may be empty)."""

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


def to_plain(value: Any) -> Any:
    """Turn an OmegaConf node into plain dicts/lists (resolved); leave anything else as it is."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


class Reward:
    """Base class: keeps ``cfg`` and ``device``; subclasses list the fields they read in ``config_fields``."""

    name: ClassVar[str] = "reward"
    config_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)

    def option(self, key: str, default: Any = None) -> Any:
        """``cfg[key]`` as plain Python data, or ``default`` when the key is absent or null."""
        value = self.cfg.get(key, default)
        return default if value is None else to_plain(value)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> RewardOutput:
        check_batch(prompts, responses)
        with torch.no_grad():
            return self.score(list(prompts), list(responses))

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        """Score one batch; runs under ``torch.no_grad()`` with inputs already checked."""
        raise NotImplementedError


def check_config_fields(cfg: ConfigLike, allowed: Sequence[str], where: str) -> None:
    """Raise ValueError for keys the reward does not read (``name`` and ``_``-prefixed keys are allowed)."""
    unknown = [str(key) for key in cfg if key != "name" and not str(key).startswith("_")]
    unknown = [key for key in unknown if key not in allowed]
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(map(repr, unknown))} for {where}; "
            f"valid fields: {', '.join(allowed) or '(none)'}"
        )


def check_batch(prompts: Sequence[str], responses: Sequence[str]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; they must pair up")


def as_scores(values: Any, expected: int, source: str) -> torch.Tensor:
    """Convert a sequence/array/tensor of ``expected`` numbers to float32 [N] on the CPU, or raise."""
    if isinstance(values, torch.Tensor):
        scores = values.detach().to("cpu", torch.float32)
    else:
        try:
            scores = torch.as_tensor(values if hasattr(values, "__array__") else list(values))
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{source} must return {expected} numbers; got {type(values).__name__}"
            ) from error
        scores = scores.to(torch.float32)
    if scores.ndim != 1:
        raise ValueError(f"{source} returned shape {tuple(scores.shape)}; expected {expected} scores (1-D)")
    if scores.shape[0] != expected:
        raise ValueError(f"{source}: expected {expected} scores (one per response), got {scores.shape[0]}")
    return scores


# --- Hugging Face sequence classifiers (shared by `classifier` and `reward_model`) -------------------------


def load_sequence_classifier(model_path: str, device: torch.device) -> tuple[Any, Any]:
    """Load an ``AutoModelForSequenceClassification`` and its tokenizer, in eval mode on ``device``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path)
    ensure_pad_token(model, tokenizer)
    return model.to(device).eval(), tokenizer


def ensure_pad_token(model: Any, tokenizer: Any) -> None:
    """Give decoder-style tokenizers a pad token (their EOS) so batches can be padded."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; cannot pad a batch")
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def resolve_max_length(model: Any, tokenizer: Any, requested: int | None = None) -> int:
    """``requested`` (if given) capped at what the tokenizer and the position embeddings accept.

    Without a request: that model limit, or 512 when neither the tokenizer nor the model states one.
    """
    limits = [] if tokenizer.model_max_length > 100_000 else [tokenizer.model_max_length]
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions:
        limits.append(positions)
    if requested is not None:
        limits.append(int(requested))
    return min(limits) if limits else 512


def tokenize(
    tokenizer: Any, texts: list[str], max_length: int, device: torch.device, add_special_tokens: bool = True
) -> dict[str, torch.Tensor]:
    """Pad and truncate a list of texts into model inputs on ``device``."""
    batch = tokenizer(
        texts,
        padding=True,
        truncation=True,
        max_length=max_length,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    return {key: value.to(device) for key, value in batch.items()}


def sequence_logits(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    batch_size: int,
    max_length: int,
    add_special_tokens: bool = True,
) -> torch.Tensor:
    """Logits [N, num_labels] (float32, CPU) of ``texts``, in mini-batches of ``batch_size``."""
    device = next(model.parameters()).device
    pieces = []
    for start in range(0, len(texts), batch_size):
        inputs = tokenize(
            tokenizer, texts[start : start + batch_size], max_length, device, add_special_tokens
        )
        pieces.append(model(**inputs).logits.float().cpu())
    if not pieces:
        return torch.zeros(0, model.config.num_labels)
    return torch.cat(pieces)


def build_reward(cfg: ConfigLike, device: str | torch.device = "cpu") -> Reward:
    """Build the reward named by ``cfg["name"]`` from the registry."""
    return get("reward", cfg["name"])(cfg, device=device)
