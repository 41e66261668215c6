"""Bad inputs, round three: sizes a run cannot fit or finish are refused before any model loads (one ``error:``
line, exit status 2, through :func:`rlhf_lab.app.cli.main` in this process), and settings a run cannot learn with
are a warning (rlhf_lab/config/validate_sizes.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_bad_inputs import TINY, Case
from test_bad_inputs_round2 import without

from rlhf_lab.app import cli
from rlhf_lab.config import compose
from tests.limits import HANG_GUARD_S

CORES = os.cpu_count() or 1
SIZES = [
    Case("group_size_a_million", ["algorithm.group_size=1000000"],
         "trainer.prompts_per_step=2 x algorithm.group_size=1000000 = 2000000 samples a step cannot fit; at most "
         "65536 (raise trainer.steps instead)"),
    Case("prompts_per_step_a_billion", ["trainer.prompts_per_step=1000000000"],
         "trainer.prompts_per_step=1000000000 x algorithm.group_size=2 = 2000000000 samples a step cannot fit; at "
         "most 65536 (raise trainer.steps instead)"),
    Case("refill_rounds_a_billion", ["algorithm=dapo", "algorithm.max_refill_rounds=1000000000"],
         "algorithm.max_refill_rounds=1000000000 cannot finish; at most 100 extra generation rounds a step"),
    Case("lora_rank_1e8", ["model.lora.enabled=true", "model.lora.r=100000000"],
         "model.lora.r=100000000 cannot fit; at most 4096 (a layer's rank is at most its width)"),
    Case("threads_100000", ["trainer.num_threads=100000"],
         f"trainer.num_threads=100000 is more than 4 threads per core of this machine's {CORES}; at most "
         f"{4 * CORES} (0: torch's default)"),
    Case("threads_negative", ["trainer.num_threads=-1"],
         f"trainer.num_threads=-1 is not a thread count; 0 (torch's default) or 1-{4 * CORES}"),
    Case("samples_every_negative", ["logger.samples_every=-1"],
         "logger.samples_every=-1 is not a step interval; 0 (no sample tables sent to the tracker) or a positive "
         "number of steps"),
    Case("temperature_1e-30", ["trainer.temperature=1e-30"],
         "trainer.temperature=1e-30 overflows the logits it divides; at least 0.001 (eval.greedy=true evaluates the "
         "most likely tokens)"),
    Case("tiny_zero_layers", ["model.tiny.num_hidden_layers=0"], "model.tiny.num_hidden_layers=0 must be at least 1"),
    Case("tiny_heads_do_not_divide", ["model.tiny.hidden_size=30"],
         "model.tiny.hidden_size=30 does not split into model.tiny.num_attention_heads=4 heads"),
    Case("tiny_kv_heads_do_not_divide", ["model.tiny.num_key_value_heads=3"],
         "model.tiny.num_attention_heads=4 does not split into groups of model.tiny.num_key_value_heads=3"),
]


@pytest.mark.parametrize("case", SIZES, ids=[case.id for case in SIZES])
def test_a_size_that_cannot_fit_or_finish_is_one_line(case: Case, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main([*without(TINY, case.overrides), *case.overrides])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {case.message}\n"
    assert list(tmp_path.iterdir()) == []  # refused before any run folder


@pytest.mark.parametrize(("overrides", "warning"), [
    (["model.lora.enabled=true", "model.lora.alpha=0"], "model.lora.alpha=0 scales the adapter's update by 0"),
    (["kl.coef=1e300"], r"kl.coef=1e\+300: the KL term outweighs any task reward"),
])
def test_a_setting_that_cannot_learn_is_a_warning(overrides: list[str], warning: str) -> None:
    with pytest.warns(UserWarning, match=warning):
        compose([*without(TINY, overrides), *overrides])


@pytest.mark.parametrize(("environ", "message"), [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 names 2 processes, but no launcher started this one (RANK and MASTER_ADDR "
                          "unset); unset them for one process, or launch with torchrun --nproc_per_node=N -m rlhf_lab"),
    ({"RANK": "1"}, "RANK=1 makes this process rank 1 of a single-process world; unset them for one process, or "
                    "launch with torchrun --nproc_per_node=N -m rlhf_lab"),
    ({"RANK": "one"}, "RANK=one: the launcher's variables are not numbers; unset them for one process, or launch "
                      "with torchrun --nproc_per_node=N -m rlhf_lab"),
], ids=["world_size_without_torchrun", "rank_one_alone", "rank_not_a_number"])
def test_a_launch_environment_that_describes_no_launch_is_one_line(environ, message, tmp_path, monkeypatch,
                                                                   capsys) -> None:
    """Stray launcher variables: torch.distributed would trace back (WORLD_SIZE alone), or the process would run
    as a non-zero rank of nothing, taking no run lock and writing no files (RANK=1 alone)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(TINY)
    assert exited.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- eval and export


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    import rlhf_lab

    folder = tmp_path_factory.mktemp("round3") / "run"
    rlhf_lab.train([*TINY, "trainer.precision=fp32"], run_dir=folder)
    return folder


def variant(trained: Path, tmp_path: Path, change: str) -> Path:
    """A copy of the trained run with one thing wrong with it."""
    import shutil

    run = Path(shutil.copytree(trained, tmp_path / change))
    step = next((run / "checkpoints").glob("step_*"))
    if change == "flipped":
        weights = step / "model" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif change == "extra_file":
        (step / "model" / "model-00002-of-00002.safetensors").write_bytes(b"planted")
    elif change == "torn_overrides":
        (run / ".hydra" / "overrides.yaml").write_text("- model=tiny\n- trainer.steps: [\n")
    elif change == "torn_summary":
        (run / "summary.json").write_text('{"steps": 1, "reward/fi')
    return run


def test_eval_and_export_refuse_a_damaged_checkpoint_in_one_line(trained: Path, tmp_path: Path, run_cli) -> None:

    for change, problem in (("flipped", "model/model.safetensors does not match its sha256 (corrupted)"),
                            ("extra_file", "model/model-00002-of-00002.safetensors is not in the manifest (added "
                                           "after the save)")):
        run = variant(trained, tmp_path, change)
        step = next((run / "checkpoints").glob("step_*"))
        expected = f"error: checkpoint {step} is damaged ({problem}); use another checkpoint of the run " \
                   "(checkpoints/step_N)\n"
        for command in (["eval", str(run)], ["export", str(run), str(tmp_path / f"out_{change}")]):
            code, _, err = run_cli(command)
            assert (code, err) == (2, expected), (command, err)


def test_eval_and_export_mistakes_about_their_files_are_one_line(trained: Path, tmp_path: Path, run_cli) -> None:
    step = next((trained / "checkpoints").glob("step_*"))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    torn = variant(trained, tmp_path, "torn_overrides")
    cases = [
        (["export", str(trained), str(a_file)], f"'{a_file}' is a file; give a folder to export into"),
        (["export", str(trained), str(step / "model"), "--force"],
         f"'{step / 'model'}' is inside the checkpoint it exports ({step}); choose a folder outside it"),
        (["eval", str(trained), "--out", str(a_file)], f"--out '{a_file}' is a file; give a folder for eval.json"),
        (["eval", str(torn)], f"'{torn / '.hydra' / 'overrides.yaml'}' is not a YAML list of overrides (torn or "
                              f"edited); evaluate {next((torn / 'checkpoints').glob('step_*')) / 'model'} as a model "
                              "folder instead"),
        (["export", str(variant(trained, tmp_path, "torn_summary")), str(tmp_path / "out")],
         f"'{tmp_path / 'torn_summary' / 'summary.json'}' is not valid JSON (torn or edited); remove it to export "
         "without it"),
    ]
    for command, message in cases:
        code, _, err = run_cli(command)
        assert (code, err) == (2, f"error: {message}\n"), (command, err)


# ---------------------------------------------------------------------------------------- folders and files


def test_folders_and_files_that_cannot_be_used_are_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    causal, torn = tmp_path / "causal_lm", tmp_path / "torn_config"
    causal.mkdir()
    (causal / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    torn.mkdir()
    (torn / "config.json").write_text('{"architectures": ["LlamaForSeq')
    cache_file = tmp_path / "cache_file"
    cache_file.write_text("x")
    cases = [
        ([], {"RLHF_LAB_CACHE": str(cache_file)},
         f"RLHF_LAB_CACHE='{cache_file}' is a file, not a folder; point it at a folder (or unset it)"),
        ([], {"RLHF_LAB_CACHE": "/sys/rlhf_lab_cache"},
         "RLHF_LAB_CACHE='/sys/rlhf_lab_cache' is not writable (*); point it at a folder you can write (or unset "
         "it)"),  # * the system's reason: read-only, not permitted
        (["reward=classifier", f"reward.model_path={causal}"], {},
         f"reward.model_path='{causal}' is a causal language model (LlamaForCausalLM), not a sequence classifier: its "
         "score head would be random; give a classifier or reward model folder (algorithm=reward_model writes one)"),
        (["reward=reward_model", f"reward.model_path={torn}"], {},
         f"reward.model_path='{torn}': its config.json is unreadable (JSONDecodeError)"),
        (["model=path", f"model.name_or_path={torn}"], {},
         f"model.name_or_path='{torn}': its config.json is unreadable (JSONDecodeError)"),
    ]
    monkeypatch.chdir(tmp_path)
    for overrides, environ, message in cases:
        with monkeypatch.context() as patch:
            for key, value in environ.items():
                patch.setenv(key, value)
            with pytest.raises(SystemExit) as exited:
                cli.main([*without(TINY, overrides), *overrides])
        before, _, after = f"error: {message}\n".partition("(*)")
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(before) and err.endswith(after) and err.count("\n") == 1, err


def test_a_reward_batch_size_below_one_and_damaged_metrics_lines() -> None:
    from rlhf_lab.registry import get
    from rlhf_lab.trackers.jsonl import read_jsonl

    with pytest.raises(ValueError, match=r"^reward.batch_size=-4 must be at least 1$"):
        get("reward", "classifier")({"name": "classifier", "model_path": "unused", "batch_size": -4})
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        path.write_bytes(b'{"step": 0, "reward/mean": 1.0}\n{"step": 1, "note": "\xff\xfe"}\n{"step": 2}\n{"st')
        assert read_jsonl(path) == [{"step": 0, "reward/mean": 1.0}, {"step": 2}]  # resume keeps the readable lines


def test_printing_the_config_checks_it_first(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--cfg job`` with a typo is the run's one-line error, not Hydra's; a good one prints and starts no run."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--cfg", "job", "model=tiny", "trainer.stpes=3"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: unknown key 'trainer.stpes'; did you mean 'trainer.steps'? valid keys of trainer: ")
    assert err.count("\n") == 1
    # The good one in its own process: Hydra's --cfg leaves its config set in the process that printed it.
    import subprocess
    import sys

    printed = subprocess.run([sys.executable, "-m", "rlhf_lab", "--cfg", "job", "model=tiny", "trainer.steps=3"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert printed.returncode == 0 and "  steps: 3\n" in printed.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm=sft"], "reward.rescale=mode_anchor rescores sampled responses, which algorithm=sft does not draw (it "
                        "learns from data): use reward.rescale=none"),
    (["algorithm=dpo"], "reward.rescale=mode_anchor rescores sampled responses, which algorithm=dpo does not draw (it "
                        "learns from data): use reward.rescale=none"),
    (["algorithm.group_size=1", "reward.rescale_anchor=group"],
     "reward.rescale=mode_anchor with reward.rescale_anchor=group rescores within a prompt's group of samples, and "
     "algorithm.group_size=1 gives it one: use algorithm.group_size of 2 or more, reward.rescale_anchor=batch, or "
     "reward.rescale=none"),
])
def test_a_rescale_the_run_would_ignore_is_refused(overrides: list[str], message: str) -> None:
    from rlhf_lab.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        compose(["model=tiny", "reward.rescale=mode_anchor", "reward.rescale_threshold=1.0", *overrides])
    assert str(refused.value) == message
