"""Bad inputs from the command line: each stops with exactly one line on stderr, no traceback, exit status 2.

Every case is a real ``python -m rlhf_lab ...`` process in a scratch folder (its working folder, where
the data files and reward module of the cases live). Config mistakes stop before any model loads; data
mistakes when the prompts are read; reward and checkpoint mistakes once the (tiny) model is there. The
processes run a few at a time in a module fixture; each case is then one test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhf_lab.data.prompts import prompt_indices
from tests.limits import HANG_GUARD_S

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "trainer.steps=1", "trainer.prompts_per_step=2", "algorithm.group_size=2",
        "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.progress_bar=false", "trainer.num_threads=1"]
ONE_TOO_MANY_RESPONSES = 5  # prompts_per_step 2 x group_size 2, plus one

REWARDS = '''
def boom(prompts, responses):
    for prompt in prompts:
        if "boom" in prompt:
            raise RuntimeError("cannot score a boom prompt")
    return [1.0] * len(responses)


def nan_for_boom(prompts, responses):
    return [float("nan") if "boom" in prompt else 1.0 for prompt in prompts]


def one_too_many(prompts, responses):
    return [0.0] * (len(responses) + 1)
'''
CALM, BOOM = "a calm prompt about a film", "a boom prompt about a film"


@dataclass
class Case:
    id: str
    overrides: list[str]
    message: str  # the one line on stderr, after "error: "


def prompt_tokens(text: str) -> int:
    """Length of a prompt as the tiny model sees it (SmolLM2's tokenizer and chat template)."""
    from transformers import AutoTokenizer

    from rlhf_lab.data.prompts import format_prompts
    from rlhf_lab.models.loading import smollm2_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    formatted = format_prompts([text], tokenizer, chat_template=True, system_prompt=None)
    return len(tokenizer(formatted, add_special_tokens=False)["input_ids"][0])


def write_jsonl(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def prepare(folder: Path) -> list[Case]:
    """Write the files the cases need into ``folder`` (the processes' working folder); return the cases.

    The cases of ``tests/test_cli.py`` (unknown options and keys, kl/lr/clip/group-size ranges, ...) are
    not repeated here.
    """
    (folder / "bad_rewards.py").write_text(textwrap.dedent(REWARDS))
    write_jsonl(folder / "two.jsonl", [CALM, BOOM])
    (folder / "empty.jsonl").write_text("\n")
    (folder / "text_column.csv").write_text("text\nhello\n")
    (folder / "model_without_config").mkdir()
    long_prompt = "Tell me about " + "the film " * 1200
    write_jsonl(folder / "long.jsonl", [CALM, long_prompt])
    torn = folder / "half" / "checkpoints" / "step_3"
    torn.mkdir(parents=True)
    (torn / "trainer_state.json").write_text('{"step": 3, "fi')

    # Which sample holds the boom prompt at step 0 (prompts are drawn in a seeded order).
    order = prompt_indices(0, 2, 2, seed=0)
    boom_sample = order.index(1) * 2
    reward_run = ["data=jsonl", "data.path=two.jsonl", "reward=python"]
    long_tokens = prompt_tokens(long_prompt)
    return [
        # --- config, before any model loads -----------------------------------------------------------
        Case("data_file_missing", ["data=jsonl", "data.path=missing.jsonl"],
             "data.path='missing.jsonl' does not exist (data=jsonl)"),
        Case("model_folder_missing", ["model=path", "model.name_or_path=./no_model"],
             "model.name_or_path='./no_model' is not a folder"),
        Case("model_folder_without_config", ["model=path", "model.name_or_path=model_without_config"],
             "model.name_or_path='model_without_config' has no config.json; it must be a folder written by "
             "save_pretrained"),
        Case("model_hub_id_offline", ["model=path", "model.name_or_path=nobody/no-such-model"],
             "model.name_or_path='nobody/no-such-model' is not a local folder, and as a hub id it is not in the "
             "local cache (HF_HUB_OFFLINE=1)"),
        Case("reward_model_folder_missing", ["reward=reward_model", "reward.model_path=./no_reward_model"],
             "reward.model_path='./no_reward_model' is not a folder"),
        Case("reward_function_no_module", ["reward=python", "reward.function=no_such_module:score"],
             "reward.function='no_such_module:score': cannot import module 'no_such_module' "
             "(ModuleNotFoundError: No module named 'no_such_module')"),
        Case("wrong_type_flag", ["model.lora.enabled=maybe"],
             "model.lora.enabled='maybe' has the wrong type; expected bool"),
        Case("top_p_above_one", ["trainer.top_p=1.5"], "trainer.top_p=1.5 is out of range; must be in (0, 1]"),
        Case("temperature_zero", ["trainer.temperature=0"],
             "trainer.temperature=0.0 is out of range; must be > 0.0"),
        Case("keep_last_n_zero", ["trainer.keep_last_n=0"], "trainer.keep_last_n=0 is out of range; must be >= 1"),
        Case("entropy_coef_negative", ["algorithm.entropy_coef=-0.01"],
             "algorithm.entropy_coef=-0.01 is out of range; must be >= 0.0"),
        Case("gamma_above_one", ["algorithm=ppo", "algorithm.mini_batch_size=2", "algorithm.gamma=1.5"],
             "algorithm.gamma=1.5 is out of range; must be in [0, 1]"),
        Case("micro_batch_not_dividing", ["trainer.micro_batch_size=3"],
             "trainer.micro_batch_size=3 does not divide the mini-batch of 4 samples"),
        Case("device_tpu", ["trainer.device=tpu"],
             "trainer.device='tpu' is not valid; choose from: auto, cpu, cuda, cuda:N"),
        Case("dtype_int8", ["trainer.dtype=int8"],
             "trainer.dtype='int8' is not valid; choose from: float32, bfloat16, float16"),
        Case("data_option_unknown", ["data=parquet"],
             "data='parquet' is not an option; choose from: csv, demonstrations, embedded_preferences, exact, hub, "
             "jsonl, local, movie_prompts, preferences, reasoning_gym"),
        Case("resume_path_missing", ["trainer.resume=no_such_run"],
             "trainer.resume='no_such_run' does not exist; give a checkpoint or run folder, or auto"),
        Case("resume_checkpoint_torn", ["trainer.resume=half/checkpoints/step_3"],
             "trainer.resume='half/checkpoints/step_3' is an incomplete checkpoint (a save was interrupted)"),
        # --- data, when the prompts are read (before the model) --------------------------------------------
        Case("csv_missing_column", ["data=csv", "data.path=text_column.csv"],
             "data.prompt_column='prompt' is not a column of text_column.csv; columns: ['text']"),
        Case("prompt_file_empty", ["data=jsonl", "data.path=empty.jsonl"],
             "data file 'empty.jsonl' is empty; it needs at least one prompt"),
        # --- once the tiny model is loaded ---------------------------------------------------------------
        Case("prompt_longer_than_context", ["data=jsonl", "data.path=long.jsonl", "data.max_prompt_tokens=100000"],
             f"train prompt 1 is {long_tokens} tokens, over the limit of 2044 (the model's context of 2048 "
             f"tokens minus trainer.max_new_tokens=4): {long_prompt[:40]!r}..."),
        Case("reward_function_raises", [*reward_run, "reward.function=bad_rewards:boom"],
             f"reward 'python' (bad_rewards:boom) raised RuntimeError on sample {boom_sample}: cannot score a boom "
             "prompt (train prompt 1)"),
        Case("reward_wrong_count", [*reward_run, "reward.function=bad_rewards:one_too_many"],
             f"reward function 'bad_rewards:one_too_many': expected 4 scores (one per response), got "
             f"{ONE_TOO_MANY_RESPONSES}"),
        Case("reward_nan_with_error", [*reward_run, "reward.function=bad_rewards:nan_for_boom",
                                       "reward.on_nonfinite=error"],
             f"reward 'python' (bad_rewards:nan_for_boom) returned nan for sample {boom_sample} (train prompt 1); "
             "reward.on_nonfinite=drop drops such samples instead"),
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Case, subprocess.CompletedProcess]]:
    folder = tmp_path_factory.mktemp("bad_inputs")
    cases = prepare(folder)

    def run(case: Case) -> subprocess.CompletedProcess:
        replaced = {o.split("=", 1)[0] for o in case.overrides}  # the command line refuses a key given twice
        command = [sys.executable, "-m", "rlhf_lab", *(o for o in TINY if o.split("=", 1)[0] not in replaced),
                   *case.overrides]
        return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = list(pool.map(run, cases))
    return {case.id: (case, result) for case, result in zip(cases, done)}


CASE_IDS = [
    "data_file_missing", "model_folder_missing", "model_folder_without_config", "model_hub_id_offline",
    "reward_model_folder_missing", "reward_function_no_module",
    "wrong_type_flag", "top_p_above_one", "temperature_zero",
    "keep_last_n_zero", "entropy_coef_negative", "gamma_above_one", "micro_batch_not_dividing",
    "device_tpu", "dtype_int8", "data_option_unknown",
    "resume_path_missing", "resume_checkpoint_torn", "csv_missing_column", "prompt_file_empty",
    "prompt_longer_than_context",
    "reward_function_raises", "reward_wrong_count", "reward_nan_with_error",
]


def test_the_table_lists_every_case(results) -> None:
    assert sorted(results) == sorted(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input_stops_with_one_line(results, case_id: str) -> None:
    case, result = results[case_id]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert errors == [f"error: {case.message}"], result.stderr[-3000:]
    assert result.returncode == 2
    assert result.stderr.rstrip().splitlines()[-1] == f"error: {case.message}"


def test_ddp_without_a_distributed_launch_names_torchrun(tmp_path: Path) -> None:
    """``trainer.strategy=ddp`` in one process would train alone: one line naming torchrun, exit 2."""
    command = [sys.executable, "-m", "rlhf_lab", *TINY, "trainer.strategy=ddp", f"trainer.output_dir={tmp_path / 'run'}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (
        "error: trainer.strategy=ddp needs a multi-process launch (WORLD_SIZE=1); launch with torchrun "
        "--nproc_per_node=N -m rlhf_lab ... (or accelerate launch)"
    )
