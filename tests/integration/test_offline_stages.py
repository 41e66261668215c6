"""End to end on ``model=tiny``: SFT, reward-model training and DPO runs write the output contract, resume
exactly, and hand their models to the next stage; the pipeline composes and runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lab.errors import ConfigError
from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.training.launch import run

WORDS = ["the", "movie", "film", "was", "plot", "acting", "story", "really", "very", "of", "about"]


def synthetic_pairs(count: int, seed: int) -> list[dict]:
    """Neutral words with "good" (chosen) or "bad" (rejected) at the same place: only that word differs."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        body = rng.choices(WORDS, k=rng.randint(2, 5))
        at = rng.randint(0, len(body))
        chosen, rejected = (" ".join([*body[:at], word, *body[at:]]) for word in ("good", "bad"))
        rows.append({"prompt": f"review {seed}-{index}: " + " ".join(rng.choices(WORDS, k=2)),
                     "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pair_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    write_jsonl(folder / "train.jsonl", synthetic_pairs(48, seed=0))
    write_jsonl(folder / "eval.jsonl", synthetic_pairs(16, seed=1))
    return folder


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory) -> Path:
    rows = [{"prompt": "Say hi", "response": "Hi there, friend."}, {"prompt": "Say bye", "response": "Bye now."},
            {"prompt": "Name a colour", "response": "Blue."}]
    return write_jsonl(tmp_path_factory.mktemp("demos") / "demos.jsonl", rows)


def stage(compose, tiny_overrides, out: Path, *overrides: str) -> dict:
    cfg = compose([*tiny_overrides(None), *overrides, f"trainer.output_dir={out}"])
    return run(cfg, out)


def train_lines(out: Path) -> list[dict]:
    return [line for line in read_jsonl(out / "metrics.jsonl") if "loss/total" in line]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


# ----------------------------------------------------------------------------------------------------- DPO
def test_dpo_contract_metrics_and_exact_resume(compose, tiny_overrides, pair_folder, tmp_path):
    common = ["algorithm=dpo", "data=preferences", f"data.path={pair_folder}", "trainer.checkpoint_every=1",
              "trainer.lr=1e-3"]
    summary = stage(compose, tiny_overrides, tmp_path / "full", *common)
    full = tmp_path / "full"
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "checkpoints/step_2", "model/config.json"):
        assert (full / name).exists(), name
    lines = read_jsonl(full / "metrics.jsonl")
    trained = train_lines(full)
    assert [line["step"] for line in trained] == [0, 1]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "loss/total", "time/step_s"):
        assert key in trained[0], key
    final_eval = [line for line in lines if "eval/reward/mean" in line][-1]
    for key in ("eval/reward/mean", "eval/kl/exact", "eval/response/length_mean", "eval/rewards/accuracies"):
        assert key in final_eval and key in summary, key
    assert trained[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # policy = reference at step 0

    stage(compose, tiny_overrides, tmp_path / "resumed", *common, "trainer.steps=1")
    stage(compose, tiny_overrides, tmp_path / "resumed", *common, "trainer.resume=auto")
    resumed = train_lines(tmp_path / "resumed")
    assert [line["step"] for line in resumed] == [0, 1]
    for key in ("loss/total", "rewards/margins", "logps/chosen"):
        assert resumed[1][key] == trained[1][key], key
    final, again = weights(full / "model"), weights(tmp_path / "resumed" / "model")
    assert all(torch.equal(final[k], again[k]) for k in final)


@pytest.mark.parametrize("loss_type,lora", [("ipo", False), ("simpo", True), ("robust", True)])
def test_dpo_variants_train_with_and_without_lora(compose, tiny_overrides, pair_folder, tmp_path, loss_type, lora):
    overrides = ["algorithm=dpo", f"algorithm.loss_type={loss_type}", "data=preferences", f"data.path={pair_folder}",
                 f"model.lora.enabled={str(lora).lower()}", "trainer.eval_prompts=0", "trainer.micro_batch_size=2"]
    if loss_type in ("robust", "simpo"):
        overrides.append("algorithm.label_smoothing=0.1")
    if loss_type in ("ipo", "simpo"):  # the per-token IPO (TRL's), the chosen response's NLL beside SimPO (CPO's)
        overrides += ["algorithm.ipo_normalize=mean"] if loss_type == "ipo" else ["algorithm.nll_weight=0.5"]
    summary = stage(compose, tiny_overrides, tmp_path / "run", *overrides)
    assert summary["loss/final"] == summary["loss/final"]  # finite
    nll = [line.get("loss/nll") for line in train_lines(tmp_path / "run")]
    assert all(value > 0 for value in nll) if loss_type == "simpo" else nll == [None] * len(nll)
    assert (tmp_path / "run" / "model" / "config.json").is_file()  # merged under LoRA



@pytest.mark.parametrize("name", ["sft", "dpo", "sft_packed"])
def test_offline_losses_are_the_model_s_own_distribution_at_any_sampling_temperature(
        compose, tiny_overrides, pair_folder, demo_file, tmp_path, name):
    """``trainer.temperature`` is the evaluation's sampling temperature; SFT's NLL and DPO's log-probs (policy and
    reference) are the unscaled model's, as TRL's: a run at 0.7 logs the numbers of a run at 1.0, and both equal
    a plain forward's log-softmax by hand (DPO's step-0 chosen log-probs)."""
    data = {"dpo": ["algorithm=dpo", "data=preferences", f"data.path={pair_folder}"],
            "sft": ["algorithm=sft", "data=demonstrations", f"data.path={demo_file}", "data.eval_fraction=0"]}
    overrides = [*data[name.split("_")[0]], *(["algorithm.packing=true"] if name == "sft_packed" else []),
                 "trainer.eval_prompts=0", "trainer.steps=1", "trainer.micro_batch_size=0"]
    runs = {}
    for temperature in (1.0, 0.7):
        out = tmp_path / str(temperature)
        stage(compose, tiny_overrides, out, *overrides, f"trainer.temperature={temperature}")
        runs[temperature] = train_lines(out)[0]
    keys = ["loss/total", *(["logps/chosen", "logps/rejected", "rewards/margins"] if name == "dpo" else [])]
    for key in keys:
        assert runs[0.7][key] == pytest.approx(runs[1.0][key], rel=1e-6, abs=1e-7), key
    if name != "dpo":
        return
    # By hand: the step's pairs through a plain forward of the initial weights, Σ log softmax of the chosen tokens.
    from rlhf_lab.data.prompts import prompt_indices
    from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer
    from rlhf_lab.offline.batch import Collator
    from rlhf_lab.offline.data import load_examples

    cfg = compose([*tiny_overrides(None), *overrides])
    tokenizer = load_tokenizer(cfg.model)
    model = build_tiny_llama(tokenizer, cfg.model.tiny, seed=cfg.seed)
    examples = load_examples(cfg.data, seed=cfg.seed, pairs=True).train
    indices = prompt_indices(0, cfg.trainer.prompts_per_step, len(examples), cfg.seed)
    rows = Collator(tokenizer, cfg.model, cfg.data).pairs([examples[i] for i in indices])
    with torch.no_grad():
        logprobs = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits.log_softmax(-1)
    chosen = []
    for row in range(0, rows.batch_size, 2):
        positions = rows.prompt_width + torch.arange(int(rows.response_mask[row].sum()))
        chosen.append(float(logprobs[row, positions - 1, rows.input_ids[row, positions]].sum()))
    assert runs[0.7]["logps/chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4)


# ----------------------------------------------------------------------------------------------------- SFT
def test_sft_loss_falls_and_eos_is_learned(compose, tiny_overrides, demo_file, tmp_path):
    from rlhf_lab.models.loading import build_tiny_llama, load_causal_lm, load_tokenizer
    from rlhf_lab.offline.batch import Collator
    from rlhf_lab.offline.data import load_examples

    overrides = ["algorithm=sft", "data=demonstrations", f"data.path={demo_file}", "data.eval_fraction=0",
                 "trainer.steps=20", "trainer.prompts_per_step=3", "trainer.lr=1e-2", "trainer.eval_prompts=0"]
    stage(compose, tiny_overrides, tmp_path / "sft", *overrides)
    losses = [line["loss/total"] for line in train_lines(tmp_path / "sft")]
    assert losses[-1] < 0.5 * losses[0]

    cfg = compose([*tiny_overrides(None), *overrides])
    tokenizer = load_tokenizer(cfg.model)
    rows = Collator(tokenizer, cfg.model, cfg.data).demonstrations(load_examples(cfg.data, pairs=False).train)
    trained = load_causal_lm(compose(["model=path", f"model.name_or_path={tmp_path / 'sft' / 'model'}"]).model,
                             tokenizer, "float32", 0)
    initial = build_tiny_llama(tokenizer, cfg.model.tiny, seed=cfg.seed)

    def eos_probability(model) -> torch.Tensor:
        """P(EOS | prompt, response) at each demonstration's end."""
        with torch.no_grad():
            logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        lengths = rows.response_mask.sum(-1).long()
        position = rows.prompt_width + lengths - 2  # the position that predicts the EOS
        probabilities = logits[torch.arange(len(lengths)), position].softmax(-1)
        return probabilities[:, tokenizer.eos_token_id]

    assert (eos_probability(trained) > 10 * eos_probability(initial)).all()
    assert (eos_probability(trained) > 0.5).all()


def test_sft_loss_counts_response_tokens_only(compose, tiny_overrides, demo_file):
    from rlhf_lab.algorithms.base import LossContext, PolicyOutput
    from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer
    from rlhf_lab.offline.batch import Collator
    from rlhf_lab.offline.data import load_examples
    from rlhf_lab.offline.sft import SFT
    from rlhf_lab.scoring.forward import response_logits
    from rlhf_lab.scoring.logprobs import gather_logprobs

    cfg = compose([*tiny_overrides(None), "algorithm=sft", "data=demonstrations", f"data.path={demo_file}",
                   "data.eval_fraction=0"])
    tokenizer = load_tokenizer(cfg.model)
    model = build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    rows = Collator(tokenizer, cfg.model, cfg.data).demonstrations(load_examples(cfg.data, pairs=False).train)
    logits, _ = response_logits(model, rows.input_ids, rows.attention_mask, rows.prompt_width, 1.0)
    output = PolicyOutput(gather_logprobs(logits, rows.response_ids) * rows.response_mask, logits, None)
    tokens = float(rows.response_mask.sum())
    loss = SFT(cfg.algorithm).loss(rows, output, LossContext(tokens, rows.batch_size)).loss

    # By hand: one plain forward; NLL of each response token (EOS included) at the position before it.
    all_logprobs = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits.log_softmax(-1)
    expected, counted = 0.0, 0
    for row in range(rows.batch_size):
        for t in range(int(rows.response_mask[row].sum())):
            position = rows.prompt_width + t
            expected -= float(all_logprobs[row, position - 1, rows.input_ids[row, position]].detach())
            counted += 1
    assert counted == tokens
    assert float(loss.detach()) == pytest.approx(expected / counted, rel=1e-4)


def test_sft_lora_output_loads_merged_and_as_adapter(compose, tiny_overrides, demo_file, tmp_path):
    from rlhf_lab.models.loading import build_tiny_llama, load_causal_lm, load_tokenizer

    base = tmp_path / "base"
    tokenizer = load_tokenizer(compose(tiny_overrides(None)).model)
    build_tiny_llama(tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0).save_pretrained(base)
    tokenizer.save_pretrained(base)
    common = ["algorithm=sft", "data=demonstrations", f"data.path={demo_file}", "model=path",
              f"model.name_or_path={base}", "model.lora.enabled=true", "trainer.lr=1e-2", "trainer.eval_prompts=0"]
    for export in ("merged", "adapter"):
        stage(compose, tiny_overrides, tmp_path / export, *common, f"algorithm.export={export}")
    assert (tmp_path / "adapter" / "model" / "adapter_config.json").is_file()
    assert not (tmp_path / "merged" / "model" / "adapter_config.json").exists()
    ids = torch.tensor([tokenizer("Say hi. Hi there")["input_ids"]])
    logits = {}
    for name, folder in (("base", base), ("merged", tmp_path / "merged" / "model"),
                         ("adapter", tmp_path / "adapter" / "model")):
        cfg = compose(["model=path", f"model.name_or_path={folder}"])
        with torch.no_grad():
            logits[name] = load_causal_lm(cfg.model, load_tokenizer(cfg.model), "float32", 0)(input_ids=ids).logits
    torch.testing.assert_close(logits["merged"], logits["adapter"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits["merged"], logits["base"], atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # the 4-D mask as a boolean, and added to the scores
@pytest.mark.parametrize("packing_length,rows", [("null", [3]), ("80", [2, 1])])  # 38 + 38 + 36 tokens
def test_sft_packing_gives_the_unpacked_logprobs_loss_and_gradient(compose, tiny_overrides, demo_file, attention,
                                                                   packing_length, rows):
    """No cross-contamination: each demonstration's per-token log-probs, the loss and its gradient are the
    same packed (several documents per row, padding after them) as unpacked (one per row), fp32."""
    from rlhf_lab.algorithms.base import LossContext
    from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer
    from rlhf_lab.offline.batch import Collator
    from rlhf_lab.offline.data import load_examples
    from rlhf_lab.offline.loop import OfflineUpdater
    from rlhf_lab.offline.packing import first_fit, resolve_length
    from rlhf_lab.offline.sft import SFT
    from rlhf_lab.scoring.logprobs import gather_logprobs

    cfg = compose([*tiny_overrides(None), "algorithm=sft", "algorithm.packing=true",
                   f"algorithm.packing_length={packing_length}", "data=demonstrations", f"data.path={demo_file}",
                   "data.eval_fraction=0"])
    tokenizer = load_tokenizer(cfg.model)
    model = build_tiny_llama(tokenizer, cfg.model.tiny, seed=0)
    model.set_attn_implementation(attention)
    collator = Collator(tokenizer, cfg.model, cfg.data)
    examples = load_examples(cfg.data, pairs=False).train
    unpacked = collator.demonstrations(examples)
    packed = collator.packed_demonstrations(examples, cfg.algorithm.packing_length)
    layout = first_fit(unpacked.attention_mask.sum(-1).tolist(), resolve_length(cfg.algorithm.packing_length, cfg.data))
    assert [len(row) for row in layout] == rows == packed.document_ids.amax(-1).tolist()

    stage_, updater = SFT(cfg.algorithm), OfflineUpdater(cfg, model, SFT(cfg.algorithm), None,
                                                         torch.device("cpu"))
    results = {}
    for name, batch in (("unpacked", unpacked), ("packed", packed)):
        model.zero_grad()
        output = updater.forward(batch)
        loss = stage_.loss(batch, output, LossContext(float(batch.response_mask.sum()), batch.batch_size)).loss
        loss.backward()
        results[name] = output.logprobs.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]

    # Each demonstration's response log-probs: row i unpacked; packed, document k of its row in the layout.
    logprobs = results["unpacked"][0]
    expected = [logprobs[i][unpacked.response_mask[i].bool()] for i in range(len(examples))]
    logprobs, got = results["packed"][0], {}
    for row, indices in enumerate(layout):
        for number, index in enumerate(indices, 1):
            where = (packed.document_ids[row, 1:] == number) & packed.response_mask[row].bool()
            got[index] = logprobs[row][where]
    for index in range(len(examples)):
        torch.testing.assert_close(got[index], expected[index], rtol=0, atol=1e-5)
    assert float(results["packed"][1]) == pytest.approx(float(results["unpacked"][1]), abs=1e-5)
    for packed_grad, unpacked_grad in zip(results["packed"][2], results["unpacked"][2], strict=True):
        torch.testing.assert_close(packed_grad, unpacked_grad, rtol=0, atol=1e-5)

    # The test can fail: documents that see each other (one causal mask over the whole row) change log-probs.
    if max(rows) > 1:
        with torch.no_grad():
            logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                           position_ids=packed.position_ids).logits[:, :-1]
        contaminated = gather_logprobs(logits.float(), packed.response_ids) * packed.response_mask
        assert (contaminated - logprobs).abs().max() > 1e-3


def test_sft_packed_run_writes_the_contract_and_trains_as_unpacked(compose, tiny_overrides, demo_file, tmp_path):
    common = ["algorithm=sft", "data=demonstrations", f"data.path={demo_file}", "trainer.checkpoint_every=1",
              "trainer.lr=1e-2"]
    summary = stage(compose, tiny_overrides, tmp_path / "packed", *common, "algorithm.packing=true")
    packed = tmp_path / "packed"
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "checkpoints/step_2", "model/config.json"):
        assert (packed / name).exists(), name
    assert summary == json.loads((packed / "summary.json").read_text())
    assert (summary["stopped_by"], summary["steps"]) == ("steps", 2)
    trained = train_lines(packed)
    assert [line["step"] for line in trained] == [0, 1]
    assert all(line["sft/packing_efficiency"] == 1.0 for line in trained)  # 2 demonstrations, one row, no pad
    for key in ("eval/reward/mean", "eval/kl/exact", "eval/loss", "eval/perplexity"):
        assert key in summary, key
    stage(compose, tiny_overrides, tmp_path / "unpacked", *common)
    unpacked = train_lines(tmp_path / "unpacked")
    for key in ("loss/total", "loss/sft", "response/length_mean"):
        assert [line[key] for line in trained] == pytest.approx([line[key] for line in unpacked], abs=1e-5), key


def test_sft_run_stops_at_its_time_budget_and_resumes_with_a_larger_one(compose, tiny_overrides, demo_file,
                                                                         tmp_path):
    """trainer.max_train_seconds=1e-9: every step exceeds it, so the run stops after step 0, whatever the speed."""
    common = ["algorithm=sft", "data=demonstrations", f"data.path={demo_file}", "trainer.steps=3", "trainer.lr=1e-2"]
    out = tmp_path / "sft"
    summary = stage(compose, tiny_overrides, out, *common, "trainer.max_train_seconds=1e-9")
    assert (summary["stopped_by"], summary["steps"]) == ("max_train_seconds", 1)
    assert [line["step"] for line in train_lines(out)] == [0]
    assert summary["eval/loss"] == [line for line in read_jsonl(out / "metrics.jsonl") if "eval/loss" in line][-1][
        "eval/loss"]
    assert (out / "model" / "config.json").is_file() and (out / "checkpoints" / "step_1").is_dir()
    resumed = stage(compose, tiny_overrides, out, *common, "trainer.max_train_seconds=1e6", "trainer.resume=auto")
    assert (resumed["stopped_by"], resumed["steps"]) == ("steps", 3)
    assert [line["step"] for line in train_lines(out)] == [0, 1, 2]


# ------------------------------------------------------------------------------------------- reward model
def test_reward_model_separates_held_out_pairs_and_loads_as_reward(compose, tiny_overrides, pair_folder, tmp_path):
    from rlhf_lab.rewards.base import build_reward

    out = tmp_path / "rm"
    summary = stage(compose, tiny_overrides, out, "algorithm=reward_model", "data=preferences",
                    f"data.path={pair_folder}", "trainer.steps=12", "trainer.prompts_per_step=16", "trainer.lr=3e-3")
    assert summary["eval/accuracy"] >= 0.95, summary
    assert summary["eval/margin_mean"] > 0
    for name in ("metrics.jsonl", "summary.json", "checkpoints/step_12", "model/config.json"):
        assert (out / name).exists(), name
    reward = build_reward({"name": "reward_model", "model_path": str(out / "model")})
    held_out = [json.loads(line) for line in (pair_folder / "eval.jsonl").read_text().splitlines()]
    prompts = [row["prompt"] for row in held_out]
    chosen = reward(prompts, [row["chosen"] for row in held_out]).scores
    rejected = reward(prompts, [row["rejected"] for row in held_out]).scores
    assert float((chosen > rejected).float().mean()) == pytest.approx(summary["eval/accuracy"])
    assert float((chosen - rejected).mean()) == pytest.approx(summary["eval/margin_mean"], rel=1e-3, abs=1e-4)


def test_reward_model_lora_resumes_exactly(compose, tiny_overrides, pair_folder, tmp_path):
    common = ["algorithm=reward_model", "data=preferences", f"data.path={pair_folder}", "model.lora.enabled=true",
              "algorithm.pooling=mean", "algorithm.center_rewards_coefficient=0.01", "trainer.checkpoint_every=1",
              "trainer.lr=1e-3"]
    stage(compose, tiny_overrides, tmp_path / "full", *common)
    stage(compose, tiny_overrides, tmp_path / "resumed", *common, "trainer.steps=1")
    stage(compose, tiny_overrides, tmp_path / "resumed", *common, "trainer.resume=auto")
    full, resumed = train_lines(tmp_path / "full"), train_lines(tmp_path / "resumed")
    assert [line["loss/total"] for line in full] == [line["loss/total"] for line in resumed]
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["precision"] == "fp32"  # what a resume under trainer.precision=auto continues in
    config = json.loads((tmp_path / "full" / "model" / "config.json").read_text())
    assert config["pooling"] == "mean" and not (tmp_path / "full" / "model" / "adapter_config.json").exists()


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides,message", [
    (["algorithm=dpo"], "algorithm=dpo trains on preference pairs; data=movie_prompts has none"),
    (["algorithm=grpo", "data=preferences", "data.path=x"], "data=preferences holds examples"),
    (["algorithm=dpo", "data=preferences", "data.path=x", "algorithm.loss_type=kto"], "algorithm.loss_type='kto'"),
    (["algorithm=dpo", "data=preferences", "data.path=x", "trainer.micro_batch_size=1"], "must be even"),
    (["algorithm=sft", "data=preferences", "data.path=x"], "use data=demonstrations"),
])
def test_offline_config_errors_are_one_line(compose, overrides, message):
    with pytest.raises(ConfigError) as error:
        compose(["model=tiny", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------- pipeline
def test_pipeline_smoke_builds_pairs_trains_every_stage_and_evaluates_with_gold(tmp_path):
    from rlhf_lab.tools.pipeline import main

    out = tmp_path / "pipeline"
    result = main([str(out), "--arms", "grpo", "--gold", "{name: length, min_words: 3, max_words: 5}",
                   "model=tiny", "trainer.steps=2", "trainer.prompts_per_step=2", "algorithm.group_size=2",
                   "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.progress_bar=false",
                   "build:data.max_prompts=8", "build:data.samples_per_prompt=3", "build:data.max_new_tokens=8",
                   "build:data.min_gap=0.0"])
    assert [row["arm"] for row in result["arms"]] == ["initial", "grpo", "dpo"]
    assert all(row["gold eval reward"] == row["gold eval reward"] for row in result["arms"])
    assert result["preferences"]["train_pairs"] > 0 and "eval/accuracy" in result["reward_model"]
    recipe = json.loads((out / "preferences" / "recipe.json").read_text())
    assert recipe["gold"]["name"] == "length" and recipe["samples_per_prompt"] == 3
    for folder in ("reward_model/model", "grpo/checkpoints", "dpo/model", "gold_eval/dpo/metrics.jsonl", "pipeline.md"):
        assert (out / folder).exists(), folder
    # One yardstick: the gold evaluations form one report, an arm per policy, RL and DPO side by side.
    from rlhf_lab.tools.report import build_report

    _, rows = build_report(out / "gold_eval")
    gold = {row["arm"]: row["eval_reward_mean"] for row in rows}
    assert set(gold) == {"policy=initial", "policy=grpo", "policy=dpo"}
    by_arm = {row["arm"]: row for row in result["arms"]}
    assert gold["policy=dpo"] == pytest.approx(by_arm["dpo"]["gold eval reward"])


def test_embedded_preferences_are_built_once_and_keep_their_recipe(compose, tmp_path):
    from rlhf_lab.errors import DataError
    from rlhf_lab.offline.builder import ensure_preferences

    folder = tmp_path / "pairs"
    overrides = ["model=tiny", "algorithm=dpo", "data=embedded_preferences", f"data.path={folder}",
                 "data.max_prompts=4", "data.samples_per_prompt=2", "data.max_new_tokens=6", "data.min_gap=0.0",
                 "data.gold={name:length}", "+data.gold.min_words=2", "+data.gold.max_words=4"]
    data = ensure_preferences(compose(overrides))
    assert data.path == str(folder) and data.margin_column == "margin"
    stamp = (folder / "train.jsonl").stat().st_mtime_ns
    ensure_preferences(compose(overrides))  # the same recipe: read back, not rebuilt
    assert (folder / "train.jsonl").stat().st_mtime_ns == stamp
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert rows and all(row["chosen_score"] - row["rejected_score"] == pytest.approx(row["margin"]) for row in rows)
    with pytest.raises(DataError, match="another recipe"):
        ensure_preferences(compose([*overrides, "data.samples_per_prompt=3"]))
