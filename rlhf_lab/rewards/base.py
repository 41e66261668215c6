"""What every reward shares: the output type, config access, and the registry entry point.

A reward is a class registered with ``@register("reward", NAME)``, built as ``RewardClass(cfg,
device="cpu")`` and called on a batch::

    reward = build_reward({"name": "sentiment", "target": "positive"})
    out = reward(prompts, responses)   # out.scores: float32 [N]; out.components: {key: [N]}

``cfg`` is an OmegaConf ``DictConfig`` or a plain dict. A reward reads the fields it lists in
``config_fields``; from the command line each reward option has its own structured schema with those
fields (``rlhf_lab/config/schema.py``), so a typo or another reward's key fails at start. Composite
components are free-form mappings, so ``composite`` checks each one with ``check_config_fields``.
Scores always come back on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lab.data.rows import columns_of
from rlhf_lab.errors import RewardError, UserError
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


def first_line(error: BaseException) -> str:
    """An exception's message on one line (its first non-empty line, or its type name)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


class Reward:
    """Base class: keeps ``cfg`` and ``device``; subclasses list the fields they read in ``config_fields``."""

    name: ClassVar[str] = "reward"
    config_fields: ClassVar[tuple[str, ...]] = ()
    # ``score`` takes the data's columns as keyword arguments, one list per column (rlhf_lab/data/rows.py)
    reads_columns: ClassVar[bool] = False

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)

    def option(self, key: str, default: Any = None) -> Any:
        """``cfg[key]`` as plain Python data, or ``default`` when the key is absent or null."""
        value = self.cfg.get(key, default)
        return default if value is None else to_plain(value)

    def describe(self) -> str:
        """How error messages name this reward: ``reward 'python' (module:function)``."""
        spec = getattr(self, "spec", None)
        return f"reward {self.name!r}" + (f" ({spec})" if spec else "")

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> RewardOutput:
        """Score a batch; any failure inside ``score`` becomes a one-line :class:`RewardError`.

        When the batch fails, samples are re-scored one at a time to name the first that fails
        (``RewardError.sample``); a batch that fails only as a whole gets no index.
        """
        check_batch(prompts, responses)
        prompts, responses = list(prompts), list(responses)
        with torch.no_grad():
            try:
                return self.score(prompts, responses, **self.columns(prompts))
            except RewardError:
                raise
            except SystemExit as stop:  # user code ending the process would end the run with nothing written
                raise RewardError(f"{self.describe()} called sys.exit({stop.code!r}); a reward returns scores "
                                  "or raises") from None
            except Exception as error:  # noqa: BLE001 (user code: any failure is reported the same way)
                sample = self._first_failing_sample(prompts, responses)
                where = f" on sample {sample}" if sample is not None else ""
                raise RewardError(
                    f"{self.describe()} raised {type(error).__name__}{where}: {first_line(error)}", sample=sample
                ) from error

    def _first_failing_sample(self, prompts: list[str], responses: list[str]) -> int | None:
        if len(responses) == 1:
            return 0
        for index in range(len(responses)):
            try:
                self.score(prompts[index : index + 1], responses[index : index + 1],
                           **self.columns(prompts[index : index + 1]))
            except Exception:  # noqa: BLE001
                return index
        return None

    def check_prompts(self, prompts: Sequence[str]) -> None:
        """Before the model loads: every prompt's row is one this reward can score (the columns it reads there and
        readable), else a one-line :class:`RewardError` naming the row (:func:`~rlhf_lab.data.rows.origin_of`).
        Nothing to check by default."""

    def columns(self, prompts: list[str]) -> dict[str, list[Any]]:
        """The data's columns this reward's ``score`` takes (all of them where ``reads_columns``, else none)."""
        return columns_of(prompts) if self.reads_columns else {}

    def score(self, prompts: list[str], responses: list[str], **columns: Any) -> RewardOutput:
        """Score one batch; runs under ``torch.no_grad()`` with inputs already checked. ``columns``: the data's
        other columns, one list per column, for a reward that ``reads_columns``."""
        raise NotImplementedError


def check_config_fields(cfg: ConfigLike, allowed: Sequence[str], where: str) -> None:
    """Raise RewardError for keys the reward does not read (``name`` and ``_``-prefixed keys are allowed)."""
    unknown = [str(key) for key in cfg if key != "name" and not str(key).startswith("_")]
    unknown = [key for key in unknown if key not in allowed]
    if unknown:
        raise RewardError(
            f"unknown field(s) {', '.join(map(repr, unknown))} for {where}; "
            f"valid fields: {', '.join(allowed) or '(none)'}"
        )


def check_batch(prompts: Sequence[str], responses: Sequence[str]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; they must pair up")


def as_scores(values: Any, expected: int, source: str) -> torch.Tensor:
    """Convert a sequence/array/tensor of ``expected`` numbers to float32 [N] on the CPU, or raise."""
    if isinstance(values, Mapping):  # list(dict) would be its keys
        raise RewardError(f"{source} returned a {type(values).__name__}; expected {expected} numbers, one per response "
                          "in order (a list, array or tensor)")
    if isinstance(values, torch.Tensor):
        scores = values.detach().to("cpu", torch.float32)
    else:
        try:
            scores = torch.as_tensor(values if hasattr(values, "__array__") else list(values))
        except (TypeError, ValueError) as error:
            raise RewardError(f"{source} must return {expected} numbers; got {type(values).__name__}") from error
        scores = scores.to(torch.float32)
    if scores.ndim != 1:
        raise RewardError(f"{source} returned shape {tuple(scores.shape)}; expected {expected} scores (1-D)")
    if scores.shape[0] != expected:
        raise RewardError(f"{source}: expected {expected} scores (one per response), got {scores.shape[0]}")
    return scores


def fill_nonfinite(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace NaN/inf scores for ``reward.on_nonfinite=drop``; return (filled [N], valid [N] bool).

    A non-finite score becomes the mean of the finite scores of its group (G = ``group_size``
    consecutive samples per prompt), or of the whole batch if its group has none, or 0 if no score is
    finite. Filling with the group mean leaves that mean, and so every mean-based baseline of the other
    samples, unchanged, and gives the dropped sample an advantage of exactly 0 under group
    normalisation. A spread statistic over the group (GRPO's std) still counts one more value, at the
    mean. The trainer also zeroes the dropped sample's response mask after advantages are computed, so
    it adds nothing to any loss.
    """
    valid = torch.isfinite(scores)
    if bool(valid.all()):
        return scores, valid
    zero = torch.zeros_like(scores)
    batch_mean = scores.where(valid, zero).sum() / valid.sum().clamp(min=1)
    groups, group_valid = scores.where(valid, zero).reshape(-1, group_size), valid.reshape(-1, group_size)
    counts = group_valid.sum(dim=1, keepdim=True)
    group_mean = groups.sum(dim=1, keepdim=True) / counts.clamp(min=1)
    fill = torch.where(counts > 0, group_mean, batch_mean).expand_as(groups).reshape(-1)
    return torch.where(valid, scores, fill), valid


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
    """Build the reward named by ``cfg["name"]`` from the registry; a constructor's complaint about its
    config (ValueError, TypeError) becomes a one-line :class:`RewardError`."""
    reward_class = get("reward", cfg["name"])
    try:
        return reward_class(cfg, device=device)
    except UserError:
        raise
    except (ValueError, TypeError) as error:
        raise RewardError(f"reward {cfg['name']!r}: {first_line(error)}") from error
