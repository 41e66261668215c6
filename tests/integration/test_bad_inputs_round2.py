"""Bad inputs, round two: each stops with exit status 2, one ``error:`` line naming the value, no traceback.

Two kinds of rows, both through the real command line, :func:`rlhf_lab.app.cli.main`:

- rows refused before Hydra starts (numbers, the output folder, the command line itself, a resume that asks
  for a change the checkpoint cannot honour) run ``main(argv)`` in this process: the same code as
  ``python -m rlhf_lab`` without a second interpreter's start-up (about 5 s each on this machine), and
  stderr must be exactly the one line;
- rows found once the job runs (data files, LoRA targets, reward constructors, a damaged checkpoint) and
  the run-folder lock (held here, so the refused process must be another one) run ``python -m rlhf_lab``
  processes, a few at a time, checked as ``test_bad_inputs.py`` checks its cases.

The earlier suite's cases stay in ``test_bad_inputs.py``; this file adds :data:`IN_PROCESS` and
:data:`PROCESS` (see :func:`test_the_count_of_bad_inputs`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_bad_inputs import CASE_IDS as EARLIER_CASE_IDS
from test_bad_inputs import TINY, Case, environment, write_jsonl

from rlhf_lab.app import cli
from rlhf_lab.training import run_lock
from tests.limits import HANG_GUARD_S

BIG_SEED = 2**70


def without(base: list[str], overrides: list[str]) -> list[str]:
    """``base`` less the keys ``overrides`` set again (the command line refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in overrides if "=" in o}
    return [o for o in base if o.split("=", 1)[0] not in keys]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rows' working folder: their data files, and ``trained/``, a finished 2-step GRPO run of TINY."""
    from rlhf_lab.config import compose
    from rlhf_lab.training.loop import Trainer

    folder = tmp_path_factory.mktemp("bad_inputs_round2")
    (folder / "numbers.jsonl").write_text('{"prompt": "a calm prompt"}\n{"prompt": 42}\n')
    (folder / "nulls.jsonl").write_text('{"prompt": null}\n')
    (folder / "lists.jsonl").write_text('{"prompt": "fine"}\n\n{"prompt": ["x", "y"]}\n')
    (folder / "latin1.jsonl").write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    write_jsonl(folder / "good.jsonl", ["a calm prompt about a film", "another prompt about a film"])
    (folder / "a_file").write_text("not a folder\n")
    Trainer(compose([*TINY, "trainer.steps=2", f"trainer.output_dir={folder / 'trained'}"]),
            folder / "trained").train()
    damaged = shutil.copytree(folder / "trained", folder / "damaged")
    weights = damaged / "checkpoints" / "step_2" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the weights: same size, other sha256
    weights.write_bytes(bytes(data))
    return folder


def read_only_folder(folder: Path) -> str:
    """A folder this process cannot write in (root writes anywhere but in /sys)."""
    if os.geteuid() == 0:
        return "/sys/rlhf_lab_run"
    locked = folder / "read_only"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    return str(locked / "run")


def in_process_cases(folder: Path) -> list[Case]:
    trained = folder / "trained"
    step_2 = trained / "checkpoints" / "step_2"
    fresh = "or start a fresh run with the new values: another trainer.output_dir, without trainer.resume"
    resume = ["trainer.steps=3", f"trainer.resume={trained}"]
    unwritable = read_only_folder(folder)
    where = "/sys" if unwritable.startswith("/sys") else str(Path(unwritable).parent)
    return [
        Case("kl_coef_nan", ["kl.coef=nan"], "kl.coef=nan is not a finite number; must be >= 0.0"),
        Case("lr_nan", ["trainer.lr=nan"], "trainer.lr=nan is not a finite number; must be > 0.0"),
        Case("lr_inf", ["trainer.lr=inf"], "trainer.lr=inf is not a finite number; must be > 0.0"),
        Case("weight_decay_nan", ["trainer.weight_decay=nan"],
             "trainer.weight_decay=nan is not a finite number; must be >= 0.0"),
        Case("max_grad_norm_nan", ["trainer.max_grad_norm=nan"],
             "trainer.max_grad_norm=nan is not a finite number; must be > 0.0"),
        Case("kl_target_inf", ["kl.controller=adaptive", "kl.target=inf"], "kl.target=inf is not a finite number"),
        Case("length_slope_nan", ["reward=length", "reward.slope_words=nan"],
             "reward.slope_words=nan is not a finite number"),
        Case("seed_2_to_the_70", [f"seed={BIG_SEED}"],
             f"seed={BIG_SEED} is out of range; must be in 0..4294967295 (2**32-1)"),
        Case("seed_negative", ["seed=-1"], "seed=-1 is out of range; must be in 0..4294967295 (2**32-1)"),
        Case("steps_past_int64", [f"trainer.steps={2**63}"],
             f"trainer.steps={2**63} is out of range; must fit a 64-bit integer (|value| < 2**63)"),
        Case("device_cuda_without_gpu", ["trainer.device=cuda"],
             "trainer.device='cuda' but no CUDA GPU is available here; use trainer.device=cpu (or auto)"),
        Case("lora_dropout_above_one", ["model.lora.enabled=true", "model.lora.dropout=1.5"],
             "model.lora.dropout=1.5 is out of range; must be in [0, 1)"),
        Case("output_dir_is_a_file", ["trainer.output_dir=a_file"],
             "trainer.output_dir='a_file' is a file, not a folder; choose a folder"),
        Case("output_dir_read_only", [f"trainer.output_dir={unwritable}"],
             f"trainer.output_dir={unwritable!r} is not writable ({where!r}: Permission denied); choose another "
             "folder"),
        Case("override_without_key", ["=5"], "'=5' has no key; write KEY=VALUE (e.g. trainer.steps=5)"),
        Case("override_given_twice", ["trainer.top_p=0.9", "trainer.top_p=1.0"],
             "trainer.top_p is given twice (trainer.top_p=0.9 and trainer.top_p=1.0); give it once"),
        Case("experimental_rerun", ["--experimental-rerun", "config.pickle"],
             "--experimental-rerun is not supported (it would unpickle a file); re-run a job with the overrides "
             "in its .hydra/overrides.yaml"),
        Case("resume_changes_algorithm", [*resume, "algorithm=reinforce"],
             f"resuming from {step_2} cannot change algorithm.name: grpo -> reinforce (only trainer.steps, "
             "trainer.lr, kl.coef and cadence, device and logging keys may change on resume); resume with "
             f"algorithm=grpo, {fresh}"),
        Case("resume_changes_seed", [*resume, "seed=7"],
             f"resuming from {step_2} cannot change seed: 0 -> 7 (only trainer.steps, trainer.lr, kl.coef and "
             f"cadence, device and logging keys may change on resume); resume with seed=0, {fresh}"),
        Case("resume_changes_lora", [*resume, "model.lora.enabled=true"],
             f"resuming from {step_2} cannot change model.lora.enabled: false -> true (only trainer.steps, "
             "trainer.lr, kl.coef and cadence, device and logging keys may change on resume); resume with "
             f"model.lora.enabled=false, {fresh}"),
        Case("resume_changes_batch_shape", [*resume, "algorithm.group_size=4", "trainer.prompts_per_step=1"],
             f"resuming from {step_2} cannot change algorithm.group_size: 2 -> 4, trainer.prompts_per_step: 2 -> 1 "
             "(only trainer.steps, trainer.lr, kl.coef and cadence, device and logging keys may change on resume); "
             f"resume with algorithm.group_size=2 trainer.prompts_per_step=2, {fresh}"),
        Case("resume_steps_below_checkpoint", [f"trainer.resume={trained}"],
             f"trainer.steps=1 is not above the step of checkpoint {step_2} (steps 0..1 are done); continue with "
             "trainer.steps>=2, or start a fresh run in another trainer.output_dir"),
    ]


def process_cases(folder: Path) -> list[Case]:
    run_dir = folder / "runs"
    jsonl = ["data=jsonl"]
    composite = ["reward=composite", "data=jsonl", "data.path=good.jsonl"]
    return [
        Case("prompt_is_a_number", [*jsonl, "data.path=numbers.jsonl"],
             "data file 'numbers.jsonl', line 2: 'prompt' is a number (42), not a string or a list of messages"),
        Case("prompt_is_null", [*jsonl, "data.path=nulls.jsonl"],
             "data file 'nulls.jsonl', line 1: 'prompt' is null (null), not a string or a list of messages"),
        Case("prompt_is_a_list", [*jsonl, "data.path=lists.jsonl"],
             "data file 'lists.jsonl', line 3: 'prompt' is a list but message 0 is not {'role': ..., 'content': '...'}"),
        Case("prompt_file_not_utf8", [*jsonl, "data.path=latin1.jsonl"],
             "data file 'latin1.jsonl', line 2: not valid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"),
        Case("lora_target_not_in_model", ["model.lora.enabled=true", "model.lora.target_modules=[nonexistent]"],
             "model.lora.target_modules: 'nonexistent' not in the model; valid names: down_proj, embed_tokens, "
             "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or all-linear)"),
        Case("composite_without_components", [*composite, "reward.components=[]"],
             "reward 'composite' needs a non-empty list of components (reward.components)"),
        Case("composite_misspelled_field", [*composite, "reward.components=[{name:length,min_wrds:3}]"],
             "unknown field(s) 'min_wrds' for composite component 'length' (reward 'length'); valid fields: "
             "min_words, max_words, slope_words, require_terminal_punctuation, format_weight"),
        Case("composite_bad_target", [*composite, "reward.components=[{name:sentiment,target:neutral}]"],
             "unknown sentiment target 'neutral'; valid targets: positive, negative"),
        Case("length_min_above_max", ["reward=length", "reward.min_words=70", "reward.max_words=10"],
             "length reward needs 0 <= min_words <= max_words; got 70, 10"),
        Case("length_slope_zero", ["reward=length", "reward.slope_words=0"],
             "length reward needs slope_words > 0; got 0.0"),
        Case("checkpoint_damaged_none_left", ["trainer.steps=3", "trainer.resume=auto",
                                              f"trainer.output_dir={folder / 'damaged'}"],
             f"checkpoint {folder / 'damaged' / 'checkpoints' / 'step_2'} is damaged (model/model.safetensors does "
             f"not match its sha256 (corrupted)) and no earlier complete checkpoint in "
             f"{folder / 'damaged' / 'checkpoints'} checks out; start a fresh run (another trainer.output_dir, "
             "without trainer.resume)"),
        Case("run_folder_in_use", [f"trainer.output_dir={run_dir / 'busy'}"],
             f"run folder {str(run_dir / 'busy')!r} is in use by process {os.getpid()} (lock "
             f"{run_dir / 'busy' / run_lock.LOCK_FILE}); wait for it to end or choose another trainer.output_dir"),
    ]


IN_PROCESS = [
    "kl_coef_nan", "lr_nan", "lr_inf", "weight_decay_nan", "max_grad_norm_nan", "kl_target_inf", "length_slope_nan",
    "seed_2_to_the_70", "seed_negative", "steps_past_int64", "device_cuda_without_gpu", "lora_dropout_above_one",
    "output_dir_is_a_file", "output_dir_read_only", "override_without_key", "override_given_twice",
    "experimental_rerun", "resume_changes_algorithm", "resume_changes_seed", "resume_changes_lora",
    "resume_changes_batch_shape", "resume_steps_below_checkpoint",
]
PROCESS = [
    "prompt_is_a_number", "prompt_is_null", "prompt_is_a_list", "prompt_file_not_utf8", "lora_target_not_in_model",
    "composite_without_components", "composite_misspelled_field", "composite_bad_target", "length_min_above_max",
    "length_slope_zero", "checkpoint_damaged_none_left", "run_folder_in_use",
]


@pytest.fixture(scope="module")
def process_results(folder: Path) -> dict[str, tuple[Case, subprocess.CompletedProcess]]:
    cases = process_cases(folder)
    run_lock.acquire(folder / "runs" / "busy")  # this process holds it: the row's process must be refused

    def run(case: Case) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rlhf_lab", *without(TINY, case.overrides), *case.overrides]
        return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            done = list(pool.map(run, cases))
    finally:
        run_lock.release(folder / "runs" / "busy")
    return {case.id: (case, result) for case, result in zip(cases, done)}


def test_the_tables_list_every_case(folder: Path) -> None:
    assert [case.id for case in in_process_cases(folder)] == IN_PROCESS
    assert [case.id for case in process_cases(folder)] == PROCESS


def test_the_count_of_bad_inputs() -> None:
    """34 new rows here, each a distinct input, besides the earlier suite's (24 when this file was written)."""
    rows = [*EARLIER_CASE_IDS, *IN_PROCESS, *PROCESS]
    assert len(set(rows)) == len(rows)
    assert len(IN_PROCESS) + len(PROCESS) == 34


@pytest.mark.parametrize("case_id", IN_PROCESS)
def test_refused_before_hydra_with_one_line(folder: Path, case_id: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    if case_id == "device_cuda_without_gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    case = next(c for c in in_process_cases(folder) if c.id == case_id)
    monkeypatch.chdir(folder)
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main([*without(TINY, case.overrides), *case.overrides])
    finally:
        run_lock._release_all()  # a refused resume took the folder's lock (held until exit by a real process)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {case.message}\n"


@pytest.mark.parametrize("case_id", PROCESS)
def test_refused_in_the_job_with_one_line(process_results, case_id: str) -> None:
    case, result = process_results[case_id]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert errors == [f"error: {case.message}"], result.stderr[-3000:]
    assert result.returncode == 2
    assert result.stderr.rstrip().splitlines()[-1] == f"error: {case.message}"


def test_a_pickle_passed_to_experimental_rerun_never_runs(tmp_path: Path) -> None:
    """Hydra's ``--experimental-rerun FILE`` unpickles FILE: refused, so the payload's code never runs."""

    class Payload:
        def __init__(self, marker: Path) -> None:
            self.marker = marker

        def __reduce__(self):
            return (os.system, (f"touch {self.marker}",))

    proof, marker = tmp_path / "proof", tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(proof)))  # the payload works: unpickling it creates its file
    assert proof.exists()
    payload = tmp_path / "config.pickle"
    payload.write_bytes(pickle.dumps(Payload(marker)))
    for flag in (["--experimental-rerun", str(payload)], [f"--experimental-rerun={payload}"], ["--exp", str(payload)]):
        result = subprocess.run([sys.executable, "-m", "rlhf_lab", *flag], cwd=tmp_path, capture_output=True,
                                text=True, timeout=HANG_GUARD_S, env=environment())
        assert result.returncode == 2, result.stderr[-2000:]
        name = flag[0].split("=", 1)[0]
        assert result.stderr == (f"error: {name} is not supported (it would unpickle a file); re-run a job with "
                                 "the overrides in its .hydra/overrides.yaml\n")
        assert not marker.exists()


def test_the_trained_fixture_recorded_its_config(folder: Path) -> None:
    """The reference every resume row compares with: the config next to the checkpoint."""
    stored = json.loads((folder / "trained" / "checkpoints" / "step_2" / "config.json").read_text())
    assert stored["seed"] == 0 and stored["algorithm"]["name"] == "grpo" and stored["trainer"]["steps"] == 2
