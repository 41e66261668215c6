"""Multi-turn episodes through the real trainer: the exact two-turn testbed reaches π* with the right mask and not
with the environment's tokens in the loss; the built-in environments run on the tiny model under GRPO, PPO and
LoRA, log their ``env/*`` metrics, and resume exactly; a bad env setting is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf_lab.errors import ConfigError
from rlhf_lab.training.loop import Trainer

# V = 3 symbols, one-symbol turns, three environment symbols between them (9 trajectories), β = 0.2, RLOO with k1
# in the reward. Measured at 150 steps (seed 1): right mask gap 0.00000, wrong mask 0.074.
TWO_TURN = ["experiment=exact_two_turn", "model.exact.symbols=3", "trainer.max_new_tokens=1", "reward.peaks=2",
            "env.peaks=2", "env.peak_reward=0.5", "env.env_tokens=3", "env.max_tokens=8", "trainer.lr=3e-3",
            "trainer.steps=150", "trainer.exact_every=0", "logger.samples_every=1000", "seed=1"]


def train(compose, overrides: list[str], folder: Path) -> list[dict]:
    Trainer(compose([*overrides, f"trainer.output_dir={folder}"]), folder).train()
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_the_two_turn_testbed_closes_the_gap_only_with_the_model_token_mask(compose, tmp_path: Path) -> None:
    right = train(compose, TWO_TURN, tmp_path / "right")[-1]
    wrong = train(compose, [*TWO_TURN, "env.loss_on_env_tokens=true"], tmp_path / "wrong")[-1]
    assert right["exact/total_probability"] == pytest.approx(1.0, abs=1e-5)
    assert right["exact/gap"] < 2e-3 and right["exact/tv_to_optimal"] < 0.03
    assert wrong["exact/gap"] > 0.03 and wrong["exact/tv_to_optimal"] > 0.2
    assert right["response/length_mean"] == 2.0 and wrong["response/length_mean"] == 5.0  # tokens in the loss
    assert right["env/turns_mean"] == 2.0 and right["env/truncated_frac"] == 0.0
    summary = json.loads((tmp_path / "right" / "summary.json").read_text())
    assert summary["exact/gap"] == right["exact/gap"]  # the summary keeps the last measured gap


def tiny_env(tiny_overrides, tmp_path: Path, env: str) -> list[str]:
    # the random tiny model writes no EOS: turns end at these stop strings, so episodes run several turns
    return [*tiny_overrides(tmp_path), f"env={env}", "trainer.max_new_tokens=6", "env.max_tokens=64",
            "env.stop=[a,e,i,o,u,n,t,s]", "trainer.eval_prompts=2", "trainer.eval_every=2"]


@pytest.mark.parametrize("extra", [["algorithm=grpo"], ["algorithm=ppo", "algorithm.mini_batch_size=0"],
                                   ["algorithm=grpo", "model.lora.enabled=true", "model.lora.r=4"]],
                         ids=["grpo", "ppo", "grpo_lora"])
def test_guess_number_runs_and_logs_its_episodes(compose, tiny_overrides, tmp_path: Path, extra) -> None:
    lines = train(compose, [*tiny_env(tiny_overrides, tmp_path, "guess_number"), *extra], tmp_path / "run")
    assert [line["step"] for line in lines if "reward/mean" in line] == [0, 1]
    for line in (line for line in lines if "reward/mean" in line):
        assert 1.0 < line["env/turns_mean"] <= 4.0 and 0.0 <= line["env/truncated_frac"] <= 1.0
        assert "env/solved" in line and line["response/length_mean"] > 0
    assert any(key.startswith("eval/") for line in lines for key in line)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    several = [s for s in samples if s["env/turns_mean"] > 1]  # the environment's answer is in the trajectory
    assert several and all("<|im_start|>user" in s["response"] for s in several)
    assert samples[0]["prompt"].startswith("user: I am thinking of a whole number from 1 to 16.")  # the opening


def test_a_multi_turn_run_resumes_exactly(compose, tiny_overrides, tmp_path: Path) -> None:
    overrides = [*tiny_env(tiny_overrides, tmp_path, "calculator"), "trainer.steps=3", "trainer.checkpoint_every=1",
                 "trainer.eval_prompts=0", "trainer.eval_every=0"]
    whole = train(compose, overrides, tmp_path / "whole")
    folder = tmp_path / "split"
    train(compose, [*overrides, "trainer.steps=2"], folder)
    resumed = train(compose, [*overrides, "trainer.resume=auto"], folder)
    strip = lambda line: {k: v for k, v in line.items() if not k.startswith(("time/", "throughput/", "perf/"))}  # noqa: E731
    assert [strip(line) for line in resumed] == [strip(line) for line in whole]
    assert all("env/tool_calls" in line and "env/tool_errors" in line for line in whole)


@pytest.mark.parametrize(("overrides", "message"), [
    (["env=guess_number", "algorithm=remax"], "algorithm.advantage=remax needs a greedy response"),
    (["env=guess_number", "algorithm=dapo"], "algorithm.overlong_window="),
    (["env=guess_number", "env.on_error=skip"], "env.on_error='skip' is not valid; choose from: error, drop"),
    (["env=nosuch"], "nosuch"),
    (["env=exact_two_turn"], "env=exact_two_turn needs model=exact"),
    (["experiment=exact_two_turn", "env.max_tokens=4"], "env.max_tokens=4 cannot hold two turns"),
])
def test_bad_env_settings_are_one_line(compose, tiny_overrides, overrides, message) -> None:
    base = [] if overrides[0].startswith("experiment=") else tiny_overrides(None)  # the experiment picks its model
    with pytest.raises(ConfigError) as raised:
        compose([*base, *overrides])
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_responses_of_one_token_train(compose, tiny_overrides, tmp_path: Path) -> None:
    """A batch whose response part is one token wide (``trainer.max_new_tokens=1``, or one-token turns) scores with
    the plain pass: the shared prompt prefill would leave nothing to continue with."""
    lines = train(compose, [*tiny_overrides(tmp_path), "trainer.max_new_tokens=1", "trainer.eval_prompts=0"],
                  tmp_path / "run")
    assert [line["step"] for line in lines] == [0, 1] and all(line["response/length_mean"] == 1.0 for line in lines)


def test_truncated_episodes_can_be_kept_out_of_the_loss(compose, tiny_overrides, tmp_path: Path) -> None:
    """``algorithm.mask_truncated`` reads the episodes' truncation: every one cut (a budget of one turn) is masked."""
    lines = train(compose, [*tiny_env(tiny_overrides, tmp_path, "guess_number"), "env.max_turns=1",
                            "algorithm.mask_truncated=true", "trainer.eval_prompts=0"], tmp_path / "run")
    for line in lines:
        assert line["env/truncated_frac"] == line["response/truncated_frac"] == line["overlong/masked_frac"]
    assert any(line["env/truncated_frac"] > 0 for line in lines)


def test_an_environment_failing_mid_run_is_one_line_and_keeps_what_was_written(tiny_overrides, run_cli,
                                                                                 tmp_path: Path) -> None:
    base = [o for o in tiny_overrides(tmp_path) if not o.startswith(("trainer.eval_prompts=", "trainer.steps="))]
    code, _, err = run_cli([*base, "plugins=[tests.env_fns]", "env.name=fails_after", "env.max_turns=1",
                            "trainer.eval_prompts=0", "trainer.steps=3"])
    assert code == 2
    (line,) = err.strip().splitlines()
    assert re.fullmatch(r"error: env=fails_after turn 1 of train prompt \d+ \('.+'\) raised ConnectionError: "
                        r"scoreboard unreachable", line), line
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0] and lines[0]["reward/mean"] == 1.0


def _size(count: int) -> str:
    return f"{count / (1 << 20):.3g} MB" if count >= 1 << 20 else f"{count / 1024:.3g} kB"


def test_a_run_ends_by_naming_its_folder_and_numbers_and_draws_no_library_bars(tiny_overrides, run_cli,
                                                                               tmp_path: Path) -> None:
    """``trainer.progress_bar=false`` quiets transformers' weight-shard bars too; the last lines say where the run
    is and its first numbers (the summary's own)."""
    code, out, err = run_cli([*tiny_overrides(tmp_path), "trainer.checkpoint_every=1"])
    assert code == 0, err
    assert "Writing model shards" not in out + err and "Loading weights" not in out + err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    lines = (out + err).strip().splitlines()
    run = tmp_path / "run"
    size = sum(path.stat().st_size for path in run.rglob("*") if path.is_file() and not path.is_symlink())
    optimizer = sum(path.stat().st_size for path in run.rglob("optimizer.safetensors"))
    assert optimizer > size // 10  # the tiny model's AdamW state: twice its weights
    assert lines[-2].endswith(f"run folder: {run.resolve()} ({_size(size)} on disk, {_size(optimizer)} of it "
                              "optimizer state: trainer.save=model keeps the model only)")
    assert f"reward, first 20% of steps {summary['reward/first_20pct_mean']:.4g}" in lines[-1]
    assert f"eval reward {summary['eval/reward/mean']:.4g}" in lines[-1]


def test_an_opening_longer_than_the_prompt_room_is_one_line(compose, tiny_overrides, tmp_path: Path) -> None:
    """An environment's opening (the calculator's system turn with its tools block) counts as prompt: past
    data.max_prompt_tokens + env.max_tokens the engine refuses it in one line naming both keys and the fix."""
    from rlhf_lab.errors import DataError

    overrides = [*tiny_env(tiny_overrides, tmp_path, "calculator"), "data.max_prompt_tokens=100", "trainer.steps=1",
                 "trainer.eval_prompts=0", "trainer.eval_every=0"]
    with pytest.raises(DataError) as raised:
        train(compose, overrides, tmp_path / "run")
    message = str(raised.value)
    assert re.fullmatch(r"prompt \d+ is \d+ tokens, over the 164 the engine has for prompts \(data.max_prompt_tokens, "
                        r"plus env.max_tokens in a multi-turn episode\); raise data.max_prompt_tokens or shorten the "
                        r"prompt", message), message
