"""Bad offline data and bad ``rlhf-lab pipeline`` command lines: each stops with exit status 2 and exactly one
``error:`` line naming the value (and the file and line or row) and the fix, no traceback, through
:func:`rlhf_lab.app.cli.main` in this process.

- :data:`DATA`: preference pairs (``algorithm=dpo``) and demonstrations (``algorithm=sft``) files that are
  malformed (rlhf_lab/offline/data.py); every format variant is covered by ``tests/unit/test_offline_data_rows.py``,
  these rows show that the command line stops in one line;
- :data:`PIPELINE`: the pipeline's own arguments and every stage's composed config are checked before any stage
  runs, so nothing is built or written under OUT.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import Case

from rlhf_lab.app import cli
from rlhf_lab.training import run_lock

OFFLINE = ["model=tiny", "trainer.steps=1", "trainer.progress_bar=false", "trainer.num_threads=1",
           "trainer.precision=fp32"]
DPO = [*OFFLINE, "algorithm=dpo", "data=preferences"]
SFT = [*OFFLINE, "algorithm=sft", "data=demonstrations"]
PAIR = {"prompt": "a film", "chosen": "a fine film", "rejected": "a dull film"}
MESSAGE = "is a list but message 0 is not {'role': ..., 'content': '...'}"
FILES = {
    "latin1.jsonl": json.dumps(PAIR).encode() + b'\n{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n',
    "latin1.csv": b"prompt,response\nsay hi,caf\xe9\n",
    "chosen_42.jsonl": json.dumps({**PAIR, "chosen": 42}).encode(),
    "rejected_strings.jsonl": json.dumps({**PAIR, "rejected": ["a", "b"]}).encode(),
    "prompt_object.jsonl": json.dumps({**PAIR, "prompt": {"text": "a film"}}).encode(),
    "messages_text.jsonl": json.dumps({"messages": "say hi"}).encode(),
    "no_role.jsonl": json.dumps({"messages": [{"content": "say hi"}]}).encode(),
    "line_42.jsonl": json.dumps(PAIR).encode() + b"\n42\n",
    "margin_nan.jsonl": json.dumps({**PAIR, "margin": float("nan")}).encode(),
    "extra_field.csv": b"prompt,chosen,rejected\na film,a fine film,a dull film\na play,fine, really,dull\n",
    "scalar.json": b"[1, 2]\n",
}
DATA = [
    Case("dpo_jsonl_not_utf8", [*DPO, "data.path=latin1.jsonl"],
         "data file 'latin1.jsonl', line 2: not valid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"),
    Case("sft_csv_not_utf8", [*SFT, "data.path=latin1.csv"],
         "data file 'latin1.csv', line 2: not valid UTF-8 (byte 0xe9 at column 11); save the file as UTF-8"),
    Case("dpo_chosen_a_number", [*DPO, "data.path=chosen_42.jsonl"],
         "row 0 of chosen_42.jsonl: column 'chosen' is 42 (a number), not text or chat messages"),
    Case("dpo_rejected_strings", [*DPO, "data.path=rejected_strings.jsonl"],
         f"row 0 of rejected_strings.jsonl: column 'rejected' {MESSAGE}"),
    Case("dpo_prompt_an_object", [*DPO, "data.path=prompt_object.jsonl"],
         "row 0 of prompt_object.jsonl: column 'prompt' is an object, not text or chat messages"),
    Case("sft_messages_text", [*SFT, "data.path=messages_text.jsonl"],
         "row 0 of messages_text.jsonl: column 'messages' is text ('say hi'), not a list of chat messages; name "
         "text columns with data.prompt_column and data.response_column"),
    Case("sft_message_without_role", [*SFT, "data.path=no_role.jsonl"],
         "row 0 of no_role.jsonl: column 'messages' is a list but message 0 has role None; roles: system, user, "
         "assistant, tool"),
    Case("dpo_line_a_number", [*DPO, "data.path=line_42.jsonl"],
         "line_42.jsonl:2 is 42 (a number), not a JSON object of a row's columns (one per line)"),
    Case("dpo_margin_nan", [*DPO, "data.path=margin_nan.jsonl", "data.margin_column=margin"],
         "row 0 of margin_nan.jsonl: column 'margin' (data.margin_column) is NaN (a number), not a finite number"),
    Case("dpo_csv_extra_field", [*DPO, "data.path=extra_field.csv"],
         "extra_field.csv:3 has 4 fields, the header has 3 (prompt, chosen, rejected); quote a field that holds a "
         "comma"),
    Case("dpo_json_not_rows", [*DPO, "data.path=scalar.json"],
         "scalar.json: item 0 of its JSON array is 1 (a number), not an object of a row's columns"),
]

ARMS = "cispo, dapo, dr_grpo, grpo, gspo, ppo, reinforce, reinforce_pp, remax, rloo"
REWARDS = ("classifier, composite, exact_table, length, math_verify, pairwise, python, reasoning_gym, reward_model, route, "
           "sentiment")
GOLD_EXAMPLE = "e.g. --gold '{name: sentiment}'"
PIPELINE = [
    Case("lr_negative", ["trainer.lr=-1"], "pipeline stage build: trainer.lr=-1.0 is out of range; must be > 0.0"),
    Case("rm_lr_not_a_number", ["rm:trainer.lr=abc"],
         "pipeline stage rm: trainer.lr='abc' has the wrong type; expected float"),
    Case("arm_lr_negative", ["ppo:trainer.lr=-1"],
         "pipeline stage ppo: trainer.lr=-1.0 is out of range; must be > 0.0"),
    Case("dpo_loss_not_an_option", ["dpo:algorithm.loss_type=kto"],
         "pipeline stage dpo: algorithm.loss_type='kto' is not valid; choose from: hinge, ipo, robust, sigmoid, simpo"),
    Case("gold_not_an_option", ["--gold", "x"],
         f"--gold 'x': reward 'x' is not an option; choose from: {REWARDS}"),
    Case("gold_not_yaml", ["--gold", "{name: sentiment"],
         "--gold '{name: sentiment' is not YAML (expected ',' or '}', but got '<stream end>'); give a reward config, "
         f"{GOLD_EXAMPLE}"),
    Case("gold_a_list", ["--gold", "[sentiment]"],
         f"--gold '[sentiment]' is not a reward config; give a mapping with a reward's name, {GOLD_EXAMPLE}"),
    Case("gold_key_typo", ["--gold", "{name: length, min_wrds: 3}"],
         "pipeline stage dpo: unknown key 'reward.min_wrds' for reward=length; did you mean 'reward.min_words'? valid "
         "keys: name, on_nonfinite, rescale, rescale_threshold, rescale_anchor, min_words, max_words, slope_words, "
         "require_terminal_punctuation, format_weight"),
    Case("arms_unknown", ["--arms", "grpo,nosuch"],
         f"--arms grpo,nosuch: 'nosuch' is not an RL algorithm; choose from: {ARMS}"),
    Case("arms_offline_stage", ["--arms", "dpo"], f"--arms dpo: 'dpo' is not an RL algorithm; choose from: {ARMS}"),
    Case("arms_twice", ["--arms", "grpo,grpo"], "--arms grpo,grpo names grpo twice; name each arm once"),
    Case("stage_unknown", ["rn:trainer.steps=2"],
         "rn:trainer.steps=2: 'rn' is not a stage; prefix an override with one of: build, rm, dpo, gold, grpo, ppo"),
    Case("flag_unknown", ["--gld", "x"], "unrecognized arguments: --gld x"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad_inputs_data")
    for name, content in FILES.items():
        (folder / name).write_bytes(content)
    (folder / "a_file").write_text("not a folder\n")
    return folder


def one_line(args: list[str], folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """Run ``rlhf-lab ARGS`` in ``folder``; assert exit status 2 and return stderr, which must be one line."""
    monkeypatch.chdir(folder)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(args)
    finally:
        run_lock._release_all()  # held until exit by a real process
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("case", DATA, ids=[case.id for case in DATA])
def test_malformed_offline_data_is_one_line(case: Case, folder: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    err = one_line([*case.overrides, f"trainer.output_dir={tmp_path / 'run'}"], folder, monkeypatch, capsys)
    assert err == f"error: {case.message}\n"


@pytest.mark.parametrize("case", PIPELINE, ids=[case.id for case in PIPELINE])
def test_a_bad_pipeline_command_is_one_line_before_any_stage(case: Case, folder: Path, monkeypatch,
                                                             capsys) -> None:
    out = folder / f"pipeline_{case.id}"
    err = one_line(["pipeline", str(out), "model=tiny", *case.overrides], folder, monkeypatch, capsys)
    assert err == f"error: {case.message}\n"
    assert not out.exists()  # refused before the pairs are built: nothing written


@pytest.mark.parametrize(("out", "message"), [
    ("a_file", "OUT '{folder}/a_file' is a file; give a folder for the stages' runs"),
    ("a_file/pipeline", "OUT '{folder}/a_file/pipeline' is inside '{folder}/a_file', a file; give a folder for the "
                        "stages' runs"),
], ids=["a_file", "inside_a_file"])
def test_a_pipeline_out_that_is_a_file_is_one_line(out: str, message: str, folder: Path, monkeypatch,
                                                   capsys) -> None:
    err = one_line(["pipeline", out, "model=tiny"], folder, monkeypatch, capsys)
    assert err == f"error: {message.format(folder=folder)}\n"
    assert (folder / "a_file").read_text() == "not a folder\n"


def test_a_stage_override_error_stops_before_the_pairs_are_built(folder: Path, monkeypatch, capsys) -> None:
    """A key typo in the last stage's overrides stops the pipeline before the first stage's work (building pairs
    took minutes on the embedded model)."""
    import rlhf_lab.offline.builder as builder

    def build(*args, **kwargs):
        raise AssertionError("the pairs were built before the stages were checked")

    monkeypatch.setattr(builder, "ensure_preferences", build)
    err = one_line(["pipeline", str(folder / "late_typo"), "model=tiny", "gold:trainer.eval_prompt=4"], folder,
                   monkeypatch, capsys)
    assert err.startswith("error: pipeline stage gold: unknown key 'trainer.eval_prompt'; did you mean 'trainer.eval_prompts'? valid keys of trainer: ")
