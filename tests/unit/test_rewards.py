"""Rewards: each checked against an exact reference (VADER itself, a direct forward pass, hand computation)."""

import os
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
)
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

import rlhf_lab.components  # noqa: F401  (registers the built-in rewards)
from rlhf_lab.offline.losses import bradley_terry_loss
from rlhf_lab.registry import get, names
from rlhf_lab.rewards.base import RewardOutput, build_reward

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
WORDS = [
    "the",
    "a",
    "movie",
    "film",
    "was",
    "is",
    "this",
    "it",
    "and",
    "but",
    "plot",
    "acting",
    "story",
    "great",
    "good",
    "bad",
    "awful",
    "terrible",
    "wonderful",
    "fine",
    "boring",
    "fun",
    "long",
    "short",
    "really",
    "very",
    "i",
    "loved",
    "hated",
    "review",
    "write",
    "of",
    "about",
]
LABELS = {0: "NEGATIVE", 1: "POSITIVE"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))  # so "tests.reward_fns:..." imports


def tiny_bert(num_labels: int, seed: int = 0, **label_kwargs) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
        **label_kwargs,
    )
    return BertForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> BertTokenizerFast:
    vocab_file = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab_file.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab=str(vocab_file))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("classifier")
    tiny_bert(2, id2label=LABELS, label2id={name: index for index, name in LABELS.items()}).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


def direct_logits(folder: Path, texts: list[str]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = BertTokenizerFast.from_pretrained(folder)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def test_all_rewards_are_registered():
    assert {"sentiment", "classifier", "reward_model", "python", "length", "composite"} <= set(
        names("reward")
    )
    assert get("reward", "sentiment").__name__ == "SentimentReward"


# --- sentiment ---------------------------------------------------------------------------------------------

SENTIMENT_TEXTS = [
    "I loved this movie, it was wonderful and the acting was great!",
    "A boring, awful film. I hated every minute.",
    "The film is 120 minutes long.",
]


def test_sentiment_matches_vader_exactly_and_flips_for_negative():
    reference = [SentimentIntensityAnalyzer().polarity_scores(text)["compound"] for text in SENTIMENT_TEXTS]
    prompts = ["Review:"] * len(SENTIMENT_TEXTS)

    positive = build_reward({"name": "sentiment"})(prompts, SENTIMENT_TEXTS)
    negative = build_reward(OmegaConf.create({"name": "sentiment", "target": "negative"}))(
        prompts, SENTIMENT_TEXTS
    )

    assert isinstance(positive, RewardOutput) and positive.components == {}
    assert positive.scores.dtype == torch.float32 and positive.scores.shape == (3,)
    assert torch.equal(positive.scores, torch.tensor(reference, dtype=torch.float32))
    assert torch.equal(negative.scores, -positive.scores)
    assert positive.scores[0] > 0.5 > -0.5 > positive.scores[1]
    assert positive.scores[2] == 0.0


def test_sentiment_rejects_unknown_target_and_mismatched_batch():
    with pytest.raises(ValueError, match=r"'neutral'.*positive, negative"):
        build_reward({"name": "sentiment", "target": "neutral"})
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_reward({"name": "sentiment"})(["a", "b"], ["c"])


def test_fields_of_other_rewards_are_ignored_at_top_level():
    # One structured config may hold every reward's fields; each reward reads only its own.
    cfg = {"name": "sentiment", "target": "negative", "function": None, "min_words": 10, "batch_size": 32}
    assert build_reward(cfg)(["p"], ["great"]).scores.item() < 0


# --- classifier --------------------------------------------------------------------------------------------

CLASSIFIER_PROMPTS = ["write a review", "a review of this film", "review"]
CLASSIFIER_RESPONSES = ["this movie was great", "awful plot and boring acting but fun", "i hated it"]


@pytest.mark.parametrize(
    ("label", "output", "index"),
    [("POSITIVE", "logit", 1), (0, "logit", 0), ("NEGATIVE", "probability", 0), (1, "probability", 1)],
)
def test_classifier_equals_direct_forward_pass(classifier_dir, label, output, index):
    reward = build_reward(
        {
            "name": "classifier",
            "model_path": str(classifier_dir),
            "label": label,
            "output": output,
            "batch_size": 2,
        }
    )
    scores = reward(CLASSIFIER_PROMPTS, CLASSIFIER_RESPONSES).scores

    logits = direct_logits(classifier_dir, CLASSIFIER_RESPONSES)
    expected = logits.softmax(-1)[:, index] if output == "probability" else logits[:, index]
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


def test_classifier_include_prompt_scores_prompt_and_response(classifier_dir):
    cfg = {"name": "classifier", "model_path": str(classifier_dir), "label": 1, "include_prompt": True}
    scores = build_reward(cfg)(CLASSIFIER_PROMPTS, CLASSIFIER_RESPONSES).scores
    texts = [prompt + " " + response for prompt, response in zip(CLASSIFIER_PROMPTS, CLASSIFIER_RESPONSES)]
    torch.testing.assert_close(scores, direct_logits(classifier_dir, texts)[:, 1], atol=1e-5, rtol=1e-5)


def test_classifier_label_and_output_errors(classifier_dir):
    cfg = {"name": "classifier", "model_path": str(classifier_dir)}
    with pytest.raises(ValueError, match=r"'NEUTRAL'.*0=NEGATIVE, 1=POSITIVE"):
        build_reward({**cfg, "label": "NEUTRAL"})
    with pytest.raises(ValueError, match=r"unknown label 2"):
        build_reward({**cfg, "label": 2})
    with pytest.raises(ValueError, match=r"'softmax'.*logit, probability"):
        build_reward({**cfg, "output": "softmax"})


# --- reward_model ------------------------------------------------------------------------------------------

NEUTRAL_WORDS = [
    "the",
    "a",
    "movie",
    "film",
    "was",
    "is",
    "this",
    "it",
    "and",
    "but",
    "plot",
    "acting",
    "story",
    "long",
    "short",
    "really",
    "very",
    "of",
    "about",
]


def synthetic_pairs(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): the same random neutral words with "good" (chosen) or "bad" (rejected)
    inserted at the same random position, so only that word tells them apart."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        prompt = " ".join(rng.choices(NEUTRAL_WORDS, k=rng.randint(1, 3)))
        body = rng.choices(NEUTRAL_WORDS, k=rng.randint(2, 6))
        position = rng.randint(0, len(body))
        chosen, rejected = ([*body[:position], word, *body[position:]] for word in ("good", "bad"))
        pairs.append((prompt, " ".join(chosen), " ".join(rejected)))
    return pairs


TRAIN_PAIRS = synthetic_pairs(32, seed=0)
HELD_OUT = synthetic_pairs(8, seed=1)


def fit_bradley_terry(model, tokenizer, pairs, folder: Path, epochs: int, lr: float, batch_size: int) -> list[float]:
    """A scalar classifier (an encoder here) fitted on (prompt, chosen, rejected) with −log σ(r_c − r_r) and
    saved as the reward reads it; the package's own trainer is the ``algorithm=reward_model`` stage."""
    model.config.pad_token_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(pairs), generator=generator).tolist()
        for start in range(0, len(pairs), batch_size):
            batch = [pairs[i] for i in order[start : start + batch_size]]
            texts = [f"{p}\n{c}" for p, c, _ in batch] + [f"{p}\n{r}" for p, _, r in batch]
            rewards = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits[:, 0]
            loss = bradley_terry_loss(rewards[: len(batch)], rewards[len(batch) :]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return losses


@pytest.fixture(scope="module")
def trained_reward_model(tmp_path_factory, tokenizer) -> tuple[Path, list[float]]:
    folder = tmp_path_factory.mktemp("reward_model")
    torch.manual_seed(0)
    losses = fit_bradley_terry(tiny_bert(1, seed=1), tokenizer, TRAIN_PAIRS, folder, epochs=3, lr=3e-3, batch_size=8)
    return folder, losses


def test_the_fitted_classifier_learned_the_pairs(trained_reward_model):
    folder, losses = trained_reward_model
    assert len(losses) == 3 * 4 and losses[-1] < 0.5 * losses[0]
    assert (folder / "model.safetensors").exists()


def test_reward_model_ranks_held_out_pairs_and_equals_direct_forward(trained_reward_model):
    folder, _ = trained_reward_model
    reward = build_reward({"name": "reward_model", "model_path": str(folder), "batch_size": 3})
    prompts = [prompt for prompt, _, _ in HELD_OUT] * 2
    responses = [chosen for _, chosen, _ in HELD_OUT] + [rejected for _, _, rejected in HELD_OUT]

    scores = reward(prompts, responses).scores

    assert scores.dtype == torch.float32 and scores.shape == (2 * len(HELD_OUT),)
    assert (scores[: len(HELD_OUT)] > scores[len(HELD_OUT) :]).all()
    texts = [prompt + "\n" + response for prompt, response in zip(prompts, responses)]
    torch.testing.assert_close(scores, direct_logits(folder, texts)[:, 0], atol=1e-5, rtol=1e-5)


def test_reward_model_normalize_and_one_label_sigmoid(trained_reward_model):
    folder, _ = trained_reward_model
    prompts, responses = ["write", "write"], ["good acting", "bad acting"]
    raw = build_reward({"name": "reward_model", "model_path": str(folder)})(prompts, responses).scores
    base = {"name": "reward_model", "model_path": str(folder)}
    as_mapping = build_reward(OmegaConf.create({**base, "normalize": {"mean": 0.5, "std": 2.0}}))
    as_flag = build_reward({**base, "normalize": True, "mean": 0.5, "std": 2.0})
    flag_off = build_reward({**base, "normalize": False, "mean": 0.5, "std": 2.0})
    torch.testing.assert_close(as_mapping(prompts, responses).scores, (raw - 0.5) / 2.0)
    torch.testing.assert_close(as_flag(prompts, responses).scores, (raw - 0.5) / 2.0)
    torch.testing.assert_close(flag_off(prompts, responses).scores, raw)
    with pytest.raises(ValueError, match="std must be > 0"):
        build_reward({**base, "normalize": {"std": 0.0}})

    # The same one-label model through `classifier`: probability means sigmoid.
    cfg = {"name": "classifier", "model_path": str(folder), "output": "probability", "include_prompt": True}
    probability = build_reward({**cfg, "separator": "\n"})(prompts, responses).scores
    torch.testing.assert_close(probability, raw.sigmoid(), atol=1e-6, rtol=1e-5)


# --- python ------------------------------------------------------------------------------------------------


def test_python_function_scores_with_kwargs():
    cfg = OmegaConf.create(
        {
            "name": "python",
            "function": "tests.reward_fns:count_letter",
            "kwargs": {"letter": "o", "scale": 0.5},
        }
    )
    out = build_reward(cfg)(["p", "q", "r"], ["foo", "bar", "ooo o"])
    assert out.scores.dtype == torch.float32
    assert out.scores.tolist() == [1.0, 0.0, 2.0]

    tensor_out = build_reward({"name": "python", "function": "tests.reward_fns:prompt_length_tensor"})(
        ["ab", "abcd"], ["x", "y"]
    )
    assert tensor_out.scores.dtype == torch.float32 and tensor_out.scores.tolist() == [2.0, 4.0]


def test_python_function_wrong_count_raises():
    reward = build_reward({"name": "python", "function": "tests.reward_fns:one_too_many"})
    with pytest.raises(ValueError, match="expected 2 scores.*got 3"):
        reward(["a", "b"], ["c", "d"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.reward_fns.count_letter", "must look like 'module:function'"),
        ("tests.no_such_module:count_letter", "cannot import module 'tests.no_such_module'"),
        ("tests.reward_fns:no_such_function", "has no attribute 'no_such_function'"),
        ("tests.reward_fns:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
    ],
)
def test_python_function_bad_spec_names_it(spec, message):
    with pytest.raises(ValueError, match=f"{spec!r}.*{message}"):
        build_reward({"name": "python", "function": spec})


# --- length ------------------------------------------------------------------------------------------------


def words(count: int) -> str:
    return " ".join(["word"] * count)


def test_length_reward_at_and_beyond_bounds():
    reward = build_reward({"name": "length", "min_words": 3, "max_words": 5, "slope_words": 2})
    responses = [words(3), words(5), words(2), words(6), "", words(20)]
    # inside: 1; one word out: 1 − 1/2; three words short: 1 − 3/2; fifteen too many: floored at −1
    assert reward(["p"] * 6, responses).scores.tolist() == [1.0, 1.0, 0.5, 0.5, -0.5, -1.0]

    defaults = build_reward({"name": "length"})
    assert defaults(["p"] * 3, [words(10), words(60), words(70)]).scores.tolist() == [1.0, 1.0, 0.5]


def test_length_reward_terminal_punctuation_term():
    cfg = {"name": "length", "min_words": 3, "max_words": 5, "require_terminal_punctuation": True}
    reward = build_reward({**cfg, "format_weight": 0.25})
    responses = ["one two three.", "one two three", 'one two "three!"  ', "one two three?", "one. two three"]
    assert reward(["p"] * 5, responses).scores.tolist() == [1.25, 0.75, 1.25, 1.25, 0.75]


# --- composite ---------------------------------------------------------------------------------------------

COMPOSITE_CFG = {
    "name": "composite",
    "components": [
        {"name": "length", "weight": 2.0, "key": "len", "min_words": 3, "max_words": 5, "slope_words": 2},
        {"name": "python", "weight": -0.5, "key": "a_count", "function": "tests.reward_fns:count_letter"},
        {"name": "length", "min_words": 1, "max_words": 1, "slope_words": 4},
    ],
}


@pytest.mark.parametrize("as_omegaconf", [False, True])
def test_composite_is_weighted_sum_with_unweighted_components(as_omegaconf):
    cfg = OmegaConf.create(COMPOSITE_CFG) if as_omegaconf else COMPOSITE_CFG
    out = build_reward(cfg)(["p", "q"], ["a a a", "banana"])

    assert list(out.components) == ["len", "a_count", "length"]
    assert out.components["len"].tolist() == [1.0, 0.0]  # 3 words; 1 word = 2 short -> 1 − 2/2
    assert out.components["a_count"].tolist() == [3.0, 3.0]
    assert out.components["length"].tolist() == [0.5, 1.0]  # 3 words = 2 over -> 1 − 2/4
    # 2·1 − 0.5·3 + 1·0.5 = 1.0;  2·0 − 0.5·3 + 1·1 = −0.5
    assert out.scores.dtype == torch.float32 and out.scores.tolist() == [1.0, -0.5]


def test_composite_errors():
    with pytest.raises(ValueError, match="duplicate composite component key 'length'"):
        build_reward(
            {"name": "composite", "components": [{"name": "length"}, {"name": "length", "weight": 2}]}
        )
    with pytest.raises(ValueError, match="non-empty list of components"):
        build_reward({"name": "composite", "components": []})
    with pytest.raises(
        ValueError,
        match=r"'mn_words' for composite component 'length' \(reward 'length'\); valid fields: min_words",
    ):
        build_reward({"name": "composite", "components": [{"name": "length", "mn_words": 2}]})
    for weight in ("abc", float("nan"), float("inf"), True, None, [1]):
        with pytest.raises(ValueError) as refused:
            build_reward({"name": "composite", "components": [{"name": "length", "key": "len", "weight": weight}]})
        assert str(refused.value) == f"composite component 'len': weight {weight!r} is not a finite number"


def test_length_reward_format_term_from_the_composed_config(compose) -> None:
    """``reward=length reward.require_terminal_punctuation=true`` alone turns the format term on (±0.5)."""
    cfg = compose(["reward=length", "reward.require_terminal_punctuation=true", "reward.min_words=1",
                   "reward.max_words=5"])
    assert cfg.reward.format_weight == 0.5
    scores = build_reward(cfg.reward)(["p", "p"], ["a short answer.", "a short answer"]).scores
    # Both are 3 words (length term 1.0); the first ends in a period (+0.5), the second does not (−0.5).
    assert scores.tolist() == [1.5, 0.5]
