"""Bad inputs, round four: the newer surfaces (environments, verifiable rewards, W&B commands, search sweeps, model
folders, run folders) as strict as the old. Each mistake is one ``error:`` line naming the value and the fix, exit
status 2, no traceback, run through :func:`rlhf_lab.app.cli.main` in this process."""

from __future__ import annotations

import json
import re

import pytest
from test_bad_inputs import TINY
from test_bad_inputs_round2 import without

ENV = [*without(TINY, ["trainer.eval_prompts=0"]), "plugins=[tests.env_fns]", "trainer.eval_prompts=0", "env.step_timeout=2", "env.max_turns=1"]


def one_line(run_cli, args: list[str]) -> str:
    code, _, err = run_cli(args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err[len("error: "):-1]


# ------------------------------------------------------------------------------------------------ environments
@pytest.mark.parametrize(("env", "extra", "pattern"), [
    ("nan_reward", [], r"env=nan_reward turn 1 of train prompt \d+ \('.+'\) raised ValueError: step's reward is nan; "
                       r"expected a finite number"),
    ("exits", [], r"env=exits turn 1 of train prompt \d+ \('.+'\) called sys.exit\(3\)"),
    ("exits", ["env.on_error=drop"], r"every one of the 4 samples failed \(env=exits turn 1 of train prompt \d+ "
                                     r"\('.+'\) called sys.exit\(3\)\); env.on_error=drop would train on nothing"),
    ("undocumented_tool", [], r"env=undocumented_tool: a tool of undocumented cannot be described to the model "
                              r"\(.+\); give each a type hint per argument and a Google-style docstring with an "
                              r"Args: section"),
    ("unencodable_reset", [], r"env=unencodable_reset reset of train prompt \d+ \('.+'\) returned messages the chat "
                              r"template cannot render \(TypeError: .+\)"),
], ids=["nan_reward", "sys_exit", "every_sample_dropped", "tool_without_docstring", "reset_not_text"])
def test_an_environment_that_breaks_its_contract_is_one_line(env, extra, pattern, tmp_path, monkeypatch,
                                                             run_cli) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_line(run_cli, [*ENV, f"env.name={env}", f"trainer.output_dir={tmp_path / 'run'}", *extra])
    assert re.fullmatch(pattern, line), line


def test_a_hung_call_does_not_time_out_the_calls_after_it(tmp_path, monkeypatch, run_cli) -> None:
    """One worker: the first step hangs; the pool is replaced and the other three samples are stepped in time
    (before, each waited behind the hung one and all four were dropped as timed out)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli([*without(ENV, ["env.step_timeout=1"]), "env.name=hangs_once", "env.workers=1",
                            "env.step_timeout=1", "env.on_error=drop",
                            f"trainer.output_dir={tmp_path / 'run'}"])
    assert code == 0, err
    (line,) = [json.loads(text) for text in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["reward/dropped"] == 1 and line["reward/mean"] == 1.0, line


def test_a_huge_environment_reply_is_cut_before_it_is_tokenised(compose, tiny_overrides, monkeypatch) -> None:
    """A 20 MB reply ends its episode as truncated (it cannot fit env.max_tokens) without being tokenised; a short
    one is tokenised and appended."""
    from rlhf_lab.envs.base import EnvState, StepResult
    from rlhf_lab.envs.chat import ChatFormat
    from rlhf_lab.envs.episodes import Episode, EpisodeRunner
    from rlhf_lab.models.loading import load_tokenizer
    from rlhf_lab.registry import get

    cfg = compose([*tiny_overrides(None), "env=guess_number", "env.max_tokens=64"])
    runner = EpisodeRunner(get("env", "guess_number")(cfg.env), load_tokenizer(cfg.model), cfg)
    seen: list[int] = []
    original = ChatFormat.continuation_ids
    monkeypatch.setattr(ChatFormat, "continuation_ids", lambda self, messages: (
        seen.append(sum(len(m["content"]) for m in messages)) or original(self, messages)))
    from rlhf_lab.errors import EnvError

    episode = Episode(0, 0, EnvState({}, 0, messages=[]), prompt_ids=[1], ids=[5, 6])
    with pytest.raises(EnvError, match=r"^env=guess_number turn 1 returned messages the chat template cannot render "
                                       r"\(TypeError: "):  # a str that is not text (a lone surrogate)
        runner._after_step(episode, StepResult([{"role": "user", "content": "\ud800"}], 0.0, False), "turn 1")
    seen.clear()
    for content, tokenised in (("lorem ipsum " * 1_700_000, False), ("higher", True)):
        episode = Episode(0, 0, EnvState({}, 0, messages=[]), prompt_ids=[1], ids=[5, 6], model=[True, True],
                          logprobs=[0.0, 0.0])
        runner._after_step(episode, StepResult([{"role": "user", "content": content}], 0.0, False), "turn 1")
        assert (episode.done, episode.truncated, len(episode.ids) > 2) == (not tokenised, not tokenised, tokenised)
    assert seen == [len("higher")]


# ------------------------------------------------------------------------------------------- settings of a run
@pytest.mark.parametrize(("overrides", "message"), [
    (["env=guess_number", "env.low=9", "env.high=2"],
     "env.low=9 is more than env.high=2; the secret is drawn from [env.low, env.high]"),
    (["env=calculator", "env.operators=+x"], "env.operators='+x' has 'x', not an operator; choose characters from "
                                             "'+-*/%'"),
    (["env=calculator", "env.operators=''"], "env.operators='' names no operator; choose characters from '+-*/%'"),
    (["env=calculator", "env.max_operand=0"], "env.max_operand=0 is out of range; must be >= 1"),
    (["env=calculator", "env.operands=0"], "env.operands=0 is out of range; must be >= 1"),
    (["data=reasoning_gym", "data.size=0"], "data.size=0 is out of range; must be >= 1 (examples of "
                                            "data.task=basic_arithmetic)"),
    (["data=reasoning_gym", "data.eval_size=-3"], "data.eval_size=-3 is out of range; must be >= 0 (examples of "
                                                  "data.task=basic_arithmetic)"),
    (["~trainer"], "~trainer removes trainer from the config, and every run reads it; remove or set one of its keys "
                   "instead (~trainer.KEY, trainer.KEY=VALUE)"),
    (["trainer.output_dir=/tmp/runs/a#b"], "'trainer.output_dir=/tmp/runs/a#b' is not an override Hydra's grammar "
                                           "reads (token recognition error at: '#'); quote the value, in the shell: "
                                           "\"trainer.output_dir='/tmp/runs/a#b'\""),
    (["experiment_name=a=b"], "'experiment_name=a=b' is not an override Hydra's grammar reads (mismatched input '=' "
                              "expecting <EOF>); quote the value, in the shell: \"experiment_name='a=b'\""),
], ids=["guess_low_above_high", "calculator_operator", "calculator_no_operator", "calculator_max_operand",
        "calculator_operands", "reasoning_gym_size_0", "reasoning_gym_eval_size", "delete_trainer",
        "hydra_grammar_folder", "hydra_grammar_name"])
def test_a_setting_no_run_can_use_is_one_line(overrides, message, tmp_path, monkeypatch, run_cli) -> None:
    monkeypatch.chdir(tmp_path)
    assert one_line(run_cli, [*without(TINY, overrides), *overrides]) == message
    assert list(tmp_path.iterdir()) == []


def test_model_folders_rlhf_lab_will_not_load_are_one_line(tmp_path, monkeypatch, run_cli) -> None:
    import torch

    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    folders = {"classifier_no_weights": ({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"},
                                         None),
               "pickled": (llama, "pytorch_model.bin"),
               "pickled_classifier": ({**llama, "architectures": ["LlamaForSequenceClassification"]},
                                      "pytorch_model.bin"),
               "remote_code": ({"model_type": "acme_secret", "auto_map": {"AutoModelForCausalLM": "modeling.Acme"}},
                               None)}
    for name, (config, weights) in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        if weights:
            torch.save({"w": torch.zeros(1)}, tmp_path / name / weights)
    pickled, remote = tmp_path / "pickled", tmp_path / "remote_code"
    pickle_message = ("holds its weights only as pickle (pytorch_model.bin), which rlhf_lab never loads; convert it "
                      "once where you trust it: model.save_pretrained(folder, safe_serialization=True)")
    cases = [
        (["reward=classifier", f"reward.model_path={tmp_path / 'classifier_no_weights'}"],
         f"reward.model_path='{tmp_path / 'classifier_no_weights'}' has no weights (*.safetensors); it must be a "
         "folder written by save_pretrained"),
        (["model=path", f"model.name_or_path={pickled}"], f"model.name_or_path='{pickled}' {pickle_message}"),
        (["reward=reward_model", f"reward.model_path={tmp_path / 'pickled_classifier'}"],
         f"reward.model_path='{tmp_path / 'pickled_classifier'}' {pickle_message}"),
        (["model=path", f"model.name_or_path={remote}"],
         f"model.name_or_path='{remote}' needs its own Python code to load (auto_map in its config.json, model_type "
         "'acme_secret' unknown to transformers); rlhf_lab runs no code from a model folder: give a model of an "
         "architecture transformers ships"),
    ]
    monkeypatch.chdir(tmp_path)
    for overrides, message in cases:
        assert one_line(run_cli, [*without(TINY, overrides), *overrides]) == message, overrides
    assert one_line(run_cli, ["eval", str(pickled)]) == f"model.name_or_path='{pickled}' {pickle_message}"


def test_a_null_answer_under_math_verify_is_one_line(tmp_path, monkeypatch, run_cli) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": None if a == 2 else str(a + 1)})
                            + "\n" for a in range(4)))
    monkeypatch.chdir(tmp_path)
    line = one_line(run_cli, [*without(TINY, ["trainer.eval_prompts=0", "trainer.prompts_per_step=4"]), "data=jsonl", f"data.path={data}", "reward=math_verify", "trainer.eval_prompts=0",
                              f"trainer.output_dir={tmp_path / 'run'}", "trainer.prompts_per_step=4"])
    assert line == (f"reward=math_verify: the data's 'answer' is empty (null) at row 2 of {data}, prompt "
                    "'What is 2 + 1?'; give every row an answer"), line


def test_an_answer_the_reward_cannot_read_is_named_before_any_model_loads(tmp_path, monkeypatch, run_cli) -> None:
    """``"answer": ""`` in row 3 of a JSONL under reward=math_verify: one line naming the file, the row and the
    prompt, said before the tokenizer or the model loads (here, loading them would fail the test)."""
    import rlhf_lab.training.loop as loop

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": "" if a == 3 else str(a + 1)})
                            + "\n" for a in range(4)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "load_tokenizer", lambda *args: pytest.fail("the tokenizer loaded before the check"))
    line = one_line(run_cli, [*without(TINY, ["trainer.eval_prompts=0", "trainer.prompts_per_step=4"]), "data=jsonl",
                              f"data.path={data}", "reward=math_verify", "trainer.eval_prompts=0",
                              f"trainer.output_dir={tmp_path / 'run'}", "trainer.prompts_per_step=4"])
    assert line == (f"reward=math_verify cannot read the data's 'answer' '' at row 3 of {data}, prompt 'What is 3 + "
                    "1?'; give it an answer math-verify parses (a number, an expression, LaTeX)"), line


# ------------------------------------------------------------------------------------------ W&B commands, Optuna
def test_wandb_commands_refuse_in_one_line(tmp_path, monkeypatch, run_cli) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    monkeypatch.chdir(tmp_path)
    cases = [
        (["wandb", "sweep", "model=tiny", "seed=0,1", "--out", str(a_file / "sweep.yaml")],
         f"--out '{a_file / 'sweep.yaml'}': '{a_file}' is a file, not a folder; give a path in a folder"),
        (["wandb", "workspace", "--entity", "me", "--out", str(a_file / "deeper" / "view.json")],
         f"--out '{a_file / 'deeper' / 'view.json'}': '{a_file}' is a file, not a folder; give a path in a folder"),
        (["wandb", "workspace", "--entity", "", "--out", "view.json"],
         "--entity '' is empty; give your W&B user or team name"),
        (["wandb", "sweep", "model=tiny", "trainer.lr=interval(1,0.1)"],
         "trainer.lr=interval(1.0, 0.1): the low end is more than the high end; write interval(0.1, 1.0)"),
        (["wandb", "sweep", "model=tiny", "trainer.lr=interval(0.001,0.1)", "trainer.lr=0.01"],
         "trainer.lr is given twice ('trainer.lr=interval(0.001,0.1)' and 'trainer.lr=0.01'); keep one"),
    ]
    for args, message in cases:
        assert one_line(run_cli, args) == message, args
    # A place nobody may write (not even root may make a folder in /sys; the reason is the system's): one line.
    for args in (["wandb", "sweep", "model=tiny", "seed=0,1", "--out", "/sys/rlhf_lab_sweep/sweep.yaml"],
                 ["wandb", "workspace", "--entity", "me", "--out", "/sys/rlhf_lab_view/view.json"]):
        message = one_line(run_cli, args)
        assert re.fullmatch(rf"--out '{re.escape(args[-1])}' cannot be written \([A-Za-z ]+\); give a path you can "
                            "write", message), message
    assert not (tmp_path / "sweep.yaml").exists()
    # A missing folder is made, as for wandb sweep (a deliberate choice: --out names where the file goes).
    code, _, err = run_cli(["wandb", "workspace", "--entity", "me", "--out", str(tmp_path / "new" / "view.json")])
    assert code == 0 and json.loads((tmp_path / "new" / "view.json").read_text()), err


def test_a_reversed_interval_of_a_search_is_one_line() -> None:
    from test_optuna import TINY as OPTUNA_TINY

    from rlhf_lab.config.compose import compose
    from rlhf_lab.errors import ConfigError

    for override in ("trainer.lr=interval(0.01,0.001)", "+hydra.sweeper.params.trainer.lr='interval(0.01,0.001)'"):
        with pytest.raises(ConfigError) as error:
            compose(["+hparams_search=lr_kl", *OPTUNA_TINY, override])
        assert str(error.value).endswith("trainer.lr=interval(0.01, 0.001): the low end is more than the high end; "
                                         "write interval(0.001, 0.01)"), str(error.value)


# ------------------------------------------------------------------------------------------ resumed files
def test_a_resumed_csv_log_that_is_not_utf8_is_kept_and_named(tmp_path, monkeypatch, run_cli) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    base = [*without(TINY, ["trainer.steps=2"]), "logger=csv", f"trainer.output_dir={run}", "trainer.checkpoint_every=1"]
    assert run_cli([*base, "trainer.steps=1"])[0] == 0
    damaged = (run / "metrics.csv").read_bytes() + b"7,\xff\xfe\n"
    (run / "metrics.csv").write_bytes(damaged)
    code, _, err = run_cli([*base, "trainer.steps=2", "trainer.resume=auto"])
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("warning:") and "metrics.csv" in line]
    assert warning == [f"warning: {run / 'metrics.csv'} is not UTF-8 text (byte {len(damaged) - 3}); kept as "
                       "metrics.csv.damaged, and the resumed run rewrites it with the damaged bytes replaced"]
    assert (run / "metrics.csv.damaged").read_bytes() == damaged  # nothing lost
    steps = [row.split(",")[0] for row in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == ["0", "0", "1", "2"]  # evaluation and training rows; the damaged row of step 7 trimmed


def test_a_damaged_rng_file_falls_back_with_a_warning(tmp_path, monkeypatch, run_cli) -> None:
    """Cut short, the newest checkpoint is not complete: the resume uses the one before and says why (before, it
    passed over it in silence)."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    base = [*without(TINY, ["trainer.steps=2"]), f"trainer.output_dir={run}", "trainer.checkpoint_every=1"]
    assert run_cli([*base, "trainer.steps=2"])[0] == 0
    rng = run / "checkpoints" / "step_2" / "rng.safetensors"
    size = rng.stat().st_size
    rng.write_bytes(rng.read_bytes()[:10])
    code, _, err = run_cli([*base, "trainer.steps=3", "trainer.resume=auto"])
    assert code == 0, err
    assert (f"warning: checkpoint {run / 'checkpoints' / 'step_2'} is damaged (rng.safetensors has 10 bytes, its "
            f"manifest says {size}); falling back to {run / 'checkpoints' / 'step_1'} (step 1)") in err.splitlines()
