"""The exact task's parts: a tokenizer of V symbols, a tiny Llama over it, the seeded reward table, and the
enumeration of all V^T responses.

Every response is exactly T = ``trainer.max_new_tokens`` symbols after a one-token prompt (``<bos>``). The
tokenizer has no EOS (generation runs T steps, the response mask is all ones) and its special tokens
(``<bos>``, ``<pad>``, ``<unk>``) get zero probability: :class:`ExactTaskLM` sets their logits to −1e9 in
every forward pass, so generation, scoring, the full-logit KL and the enumeration all see a distribution
over the V symbols only, and the V^T responses carry the whole probability mass.

With ``model.exact.stop`` the last symbol ends a response (it is the tokenizer's EOS, kept in the response as any
engine keeps its EOS, and never its first token, as engines sample one token before an EOS): a response is cut at
its first stop, so the responses are of every length from 2 to T tokens (1 where T = 1). Each is written as its T-symbol
row with the stop symbol repeated after the first (its canonical row, :func:`canonical`), so the enumeration and the
reward table keep their shapes; a response's probability is its tokens' up to and including the first stop
(:func:`response_mask`), and the canonical rows carry the whole mass.
"""

from __future__ import annotations

import functools
import itertools
import string
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerFast

PROMPT = "<bos>"  # the single prompt token
SPECIAL_TOKENS = (PROMPT, "<pad>", "<unk>")  # ids 0, 1, 2; the symbols follow
SYMBOL_NAMES = string.ascii_lowercase  # "a", "b", ...: at most 26 symbols
MAX_SEQUENCES = 1 << 16  # V^T above this is too many to enumerate every step
SPECIAL_LOGIT = -1e9  # finite: exp underflows to 0 without inf − inf = NaN in log-ratios


def symbols(count: int) -> list[str]:
    """The first ``count`` symbol names."""
    if not 2 <= count <= len(SYMBOL_NAMES):
        raise ValueError(f"model.exact.symbols={count} is out of range; must be in [2, {len(SYMBOL_NAMES)}]")
    return list(SYMBOL_NAMES[:count])


def build_tokenizer(symbol_count: int, stop: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (``tokenizers``) of the special tokens and ``symbol_count`` symbols, responses
    written as space-separated symbols ("a c b d"); left padding, no chat template; no EOS, or with ``stop`` the
    last symbol as EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = symbols(symbol_count)
    vocabulary = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *names])}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=PROMPT, pad_token="<pad>", unk_token="<unk>",
                                   padding_side="left", **({"eos_token": names[-1]} if stop else {}))


@functools.cache
def _exact_task_lm() -> type:
    """The model class, made on first use: importing ``transformers``' model classes sets up torch's compiler (it
    writes ``TORCHINDUCTOR_CACHE_DIR``), which reading a config or scoring a response must not do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class ExactTaskLM(LlamaForCausalLM):
        """A ``LlamaForCausalLM`` whose special tokens have zero probability: their logits are set to −1e9 (a
        fixed, non-trainable mask) in every forward pass, generation and scoring alike, LoRA-wrapped or not. With a
        stop symbol (the config's EOS) a response's first token is never it, as every engine samples at least one
        token before its EOS: after the prompt's ``<bos>`` its logit is −1e9 too."""

        def __init__(self, config: LlamaConfig) -> None:
            super().__init__(config)
            special = torch.zeros(config.vocab_size, dtype=torch.bool)
            special[: len(SPECIAL_TOKENS)] = True
            self.register_buffer("special_tokens", special, persistent=False)
            first = special.clone()
            if config.eos_token_id is not None:
                first[config.eos_token_id] = True
            self.register_buffer("first_tokens", first, persistent=False)  # what cannot follow <bos>

        @property
        def allowed_token_ids(self) -> list[int]:
            """The symbols' ids: what an engine that samples outside this forward (vLLM) may draw."""
            return (~self.special_tokens).nonzero().squeeze(-1).tolist()

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output = super().forward(*args, **kwargs)
            if output.logits is not None:
                output.logits = output.logits.masked_fill(self.special_tokens, SPECIAL_LOGIT)
                input_ids = kwargs.get("input_ids", args[0] if args else None)
                if self.config.eos_token_id is not None and input_ids is not None:
                    after_prompt = (input_ids == self.config.bos_token_id)[..., -output.logits.shape[1]:, None]
                    output.logits = output.logits.masked_fill(after_prompt & self.first_tokens, SPECIAL_LOGIT)
            return output

    ExactTaskLM.__qualname__ = "ExactTaskLM"  # as if defined at the top of the module (pickle, repr)
    return ExactTaskLM


def __getattr__(name: str) -> Any:
    """``ExactTaskLM`` (see :func:`_exact_task_lm`); ``pickle`` finds the class here by its name too."""
    if name == "ExactTaskLM":
        return _exact_task_lm()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(tokenizer: PreTrainedTokenizerFast, dims: Any) -> Any:
    """The exact task's policy (an ``ExactTaskLM``), initialised from ``dims.init_seed`` (so every run of the task
    starts from, and is regularised towards, the same reference); its EOS the tokenizer's (the stop symbol, or none:
    generation runs ``max_new_tokens``)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size,
        num_hidden_layers=dims.num_hidden_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads,
        max_position_embeddings=64,
        initializer_range=dims.init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dims.init_seed)
        model = _exact_task_lm()(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# ------------------------------------------------------------------------------------------ responses


def all_responses(symbol_count: int, length: int, stop: bool = False) -> Tensor:
    """Every response as symbol indices, in table order (index = base-V number, first symbol most
    significant): [V^T, T] long; with ``stop``, the canonical rows only (:func:`canonical`) whose first symbol is
    not the stop (an engine samples one token before its EOS)."""
    count = symbol_count**length
    if count > MAX_SEQUENCES:
        raise ValueError(f"the exact task has {symbol_count}^{length} = {count} responses, over the "
                         f"{MAX_SEQUENCES} that can be enumerated; lower model.exact.symbols or trainer.max_new_tokens")
    rows = torch.tensor(list(itertools.product(range(symbol_count), repeat=length)), dtype=torch.long)
    return rows[(canonical(rows, symbol_count) == rows).all(-1) & (rows[:, 0] != symbol_count - 1)] if stop else rows


def canonical(rows: Tensor, symbol_count: int) -> Tensor:
    """[..., T] symbol indices with every symbol after the first stop symbol (the last, V − 1) set to it: the one row
    that stands for a response that ended there."""
    stop = symbol_count - 1
    after = torch.cumsum((rows == stop).long(), -1) - (rows == stop).long() > 0
    return torch.where(after, torch.full_like(rows, stop), rows)


def response_mask(rows: Tensor, symbol_count: int, stop: bool) -> Tensor:
    """[..., T] float: 1 on a response's tokens (with ``stop``: up to and including the first stop symbol)."""
    if not stop:
        return torch.ones(rows.shape, dtype=torch.float32)
    seen = torch.cumsum((rows == symbol_count - 1).long(), -1)
    return ((seen - (rows == symbol_count - 1).long()) == 0).float()


def table_index(symbol_indices: Tensor, symbol_count: int) -> Tensor:
    """Row of each response in the table: [..., T] symbol indices -> [...] (base-V number)."""
    length = symbol_indices.shape[-1]
    place = symbol_count ** torch.arange(length - 1, -1, -1, device=symbol_indices.device)
    return (symbol_indices * place).sum(-1)


def token_ids(symbol_indices: Tensor) -> Tensor:
    """Symbol indices -> the tokenizer's ids (the symbols follow the special tokens)."""
    return symbol_indices + len(SPECIAL_TOKENS)


def parse_response(text: str, symbol_count: int, length: int, stop: bool = False) -> list[int]:
    """A decoded response ("a c b d") -> its symbol indices; ValueError if it is not T known symbols. With ``stop``,
    cut after its first stop symbol (never its first) and written as its canonical row; a decode that skipped the
    EOS leaves it out, so a response shorter than T ended with it."""
    names = symbols(symbol_count)
    parts = text.split()
    if stop and names[-1] in parts:
        parts = parts[: parts.index(names[-1]) + 1]
    short = stop and 1 <= len(parts) < length and parts[0] != names[-1]
    if not (len(parts) == length or short) or any(part not in names for part in parts) or (
            stop and parts and parts[0] == names[-1]):
        within = f"1 to {length}" if stop else f"{length}"
        raise ValueError(f"{text!r} is not {within} symbols of {''.join(names)} (is trainer.max_new_tokens "
                         f"the reward's length, {length}?)")
    return [names.index(part) for part in parts] + [symbol_count - 1] * (length - len(parts))


def reward_table(symbol_count: int, length: int, seed: int, peaks: int, peak_reward: float,
                 noise: float, modes: int = 0, stop: bool = False) -> Tensor:
    """R(y) for all V^T responses (float64, table order): noise·u(y) with u ~ U[0, 1) for every y, plus, for
    ``peaks`` responses drawn without replacement, peak_reward·(1 − k/peaks) for the k-th (k = 0, 1, ...).
    With ``modes`` = M ≥ 2 the first M of them instead score exactly ``peak_reward`` (no noise): M equally rewarded
    optimal responses, over which π* spreads its mass by the reference's weights (the mode-collapse variant).
    Seeded by ``seed`` alone, so the table is the same for every run of the task. With ``stop`` the peaks are drawn
    among the canonical rows (the responses there are); the table keeps every row, indexed as without."""
    count = symbol_count**length
    rows = all_responses(symbol_count, length, stop)
    if not 0 <= peaks <= rows.shape[0]:
        raise ValueError(f"reward.peaks={peaks} is out of range; must be in [0, {rows.shape[0]}] (the responses)")
    if modes == 1 or not 0 <= modes <= peaks:
        raise ValueError(f"reward.modes={modes} is out of range; must be 0 (off) or in [2, reward.peaks={peaks}]")
    generator = torch.Generator().manual_seed(seed)
    rewards = noise * torch.rand(count, generator=generator, dtype=torch.float64)
    chosen = table_index(rows, symbol_count)[torch.randperm(rows.shape[0], generator=generator)[:peaks]]
    rewards[chosen] += peak_reward * (1.0 - torch.arange(peaks, dtype=torch.float64) / max(peaks, 1))
    rewards[chosen[:modes]] = peak_reward  # ties: the optimal modes
    return rewards
