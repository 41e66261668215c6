"""The resume contract, one test per rule: a resumed run honours a change (``trainer.lr``, ``kl.coef``,
``trainer.steps`` upward, cadence and logging keys) or refuses it at start with one line; never ignores it.

In-process on the tiny model: one 2-step GRPO run (checkpoint ``step_2``) is resumed under each change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlhf_lab.training import resume_contract
from rlhf_lab.training.loop import Trainer
from rlhf_lab.training.resume_contract import MAY_CHANGE, ResumeRefused, check_changes

BASE = ["trainer.eval_prompts=0", "trainer.lr=1e-3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of the tiny model: ``run/checkpoints/step_2`` with its config."""
    from conftest import compose, tiny_overrides

    run_dir = tmp_path_factory.mktemp("resume_contract") / "run"
    Trainer(compose([*tiny_overrides(None), *BASE]), run_dir).train()
    return run_dir


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run that a test may resume into."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def resumed(compose, tiny_overrides, run_dir: Path, *overrides: str) -> Trainer:
    return Trainer(compose([*tiny_overrides(None), *BASE, "trainer.resume=auto", *overrides]), run_dir)


def test_lr_and_kl_coef_changes_are_applied_to_the_optimizer_and_controller(compose, tiny_overrides, run_dir,
                                                                            capsys) -> None:
    trainer = resumed(compose, tiny_overrides, run_dir, "trainer.steps=3", "trainer.lr=0.5", "kl.coef=0.5")
    assert trainer.start_step == 2
    assert [group["lr"] for group in trainer.updater.optimizer.param_groups] == [0.5]
    assert trainer.updater.scheduler.base_lrs == [0.5] and trainer.updater.scheduler.get_last_lr() == [0.5]
    assert trainer.kl_controller.coef == 0.5
    assert "resuming with changed kl.coef: 0.05 -> 0.5, trainer.steps: 2 -> 3, trainer.lr: 0.001 -> 0.5" in (
        capsys.readouterr().out)
    trainer.train()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert (lines[2]["lr"], lines[2]["kl/coef"]) == (0.5, 0.5)  # the new values ran
    assert (lines[1]["lr"], lines[1]["kl/coef"]) == (1e-3, 0.05)
    stored = json.loads((run_dir / "checkpoints" / "step_3" / "config.json").read_text())
    assert (stored["trainer"]["lr"], stored["kl"]["coef"], stored["trainer"]["steps"]) == (0.5, 0.5, 3)


def test_a_decaying_schedule_continues_over_the_new_steps(compose, tiny_overrides, tmp_path) -> None:
    run_dir = tmp_path / "run"
    Trainer(compose([*tiny_overrides(None), *BASE, "trainer.lr_schedule=linear", "trainer.steps=2"]), run_dir).train()
    trainer = resumed(compose, tiny_overrides, run_dir, "trainer.lr_schedule=linear", "trainer.steps=4",
                      "trainer.lr=2e-3")
    scheduler = trainer.updater.scheduler
    assert scheduler.last_epoch == 2
    assert trainer.updater.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * (1 - 2 / 4))


def test_steps_may_go_up_but_not_to_the_checkpoints_step(compose, tiny_overrides, run_dir) -> None:
    step_2 = run_dir / "checkpoints" / "step_2"
    assert check_changes(compose([*tiny_overrides(None), *BASE, "trainer.steps=5"]), step_2) == {
        "trainer.steps": (2, 5)
    }
    assert check_changes(compose([*tiny_overrides(None), *BASE, "trainer.steps=2"]), step_2) == {}
    with pytest.raises(ResumeRefused) as raised:
        check_changes(compose([*tiny_overrides(None), *BASE, "trainer.steps=1"]), step_2)
    assert str(raised.value) == (
        f"trainer.steps=1 is not above the step of checkpoint {step_2} (steps 0..1 are done); continue with "
        "trainer.steps>=2, or start a fresh run in another trainer.output_dir"
    )


@pytest.mark.parametrize(("overrides", "listed", "keep"), [
    (["seed=7"], "seed: 0 -> 7", "seed=0"),
    (["algorithm=rloo"], "algorithm.name: grpo -> rloo", "algorithm=grpo"),
    (["kl=kl"], "kl.name: k3 -> kl", "kl=k3"),
    (["model.lora.enabled=true"], "model.lora.enabled: false -> true", "model.lora.enabled=false"),
    (["algorithm.group_size=4"], "algorithm.group_size: 2 -> 4", "algorithm.group_size=2"),
    (["trainer.max_new_tokens=8"], "trainer.max_new_tokens: 4 -> 8", "trainer.max_new_tokens=4"),
    (["reward=length"], "reward.name: sentiment -> length", "reward=sentiment"),
    (["data.max_prompt_tokens=64"], "data.max_prompt_tokens: 256 -> 64", "data.max_prompt_tokens=256"),
    (["trainer.weight_decay=0.1"], "trainer.weight_decay: 0.0 -> 0.1", "trainer.weight_decay=0.0"),
], ids=["seed", "algorithm", "kl", "lora", "group_size", "max_new_tokens", "reward", "data", "weight_decay"])
def test_any_other_change_is_refused_with_one_line(compose, tiny_overrides, run_dir, overrides, listed, keep) -> None:
    step_2 = run_dir / "checkpoints" / "step_2"
    with pytest.raises(ResumeRefused) as raised:
        check_changes(compose([*tiny_overrides(None), *BASE, "trainer.steps=3", *overrides]), step_2)
    assert str(raised.value) == (
        f"resuming from {step_2} cannot change {listed} (only trainer.steps, trainer.lr, kl.coef and cadence, "
        f"device and logging keys may change on resume); resume with {keep}, or start a fresh run with the new "
        "values: another trainer.output_dir, without trainer.resume"
    )


def test_cadence_device_and_logging_keys_may_change(compose, tiny_overrides, run_dir) -> None:
    changes = ["trainer.eval_every=1", "trainer.checkpoint_every=1", "trainer.keep_last_n=3", "trainer.device=cpu",
               "trainer.samples_per_step_logged=1", "logger.samples_every=1", "trainer.micro_batch_size=2"]
    changed = check_changes(compose([*tiny_overrides(None), *BASE, *changes]), run_dir / "checkpoints" / "step_2")
    assert set(changed) == {"trainer.eval_every", "trainer.checkpoint_every", "trainer.keep_last_n",
                            "trainer.device", "trainer.samples_per_step_logged", "logger.samples_every",
                            "trainer.micro_batch_size"}
    assert all(resume_contract.may_change(key) for key in changed)
    assert "trainer.steps" in MAY_CHANGE and not resume_contract.may_change("seed")


def test_a_refused_resume_stops_before_anything_loads(compose, tiny_overrides, run_dir, monkeypatch) -> None:
    def must_not_load(*args, **kwargs):
        raise AssertionError("nothing may load before the resume is checked")

    monkeypatch.setattr("rlhf_lab.training.loop.load_prompts", must_not_load)
    monkeypatch.setattr("rlhf_lab.training.loop.build_policy", must_not_load)
    with pytest.raises(ResumeRefused, match=r"cannot change seed: 0 -> 7"):
        resumed(compose, tiny_overrides, run_dir, "trainer.steps=3", "seed=7")


def test_a_refused_resume_puts_hydras_record_back(tmp_path: Path, monkeypatch) -> None:
    """Hydra rewrote ``.hydra/`` before the job saw the refusal: the last segment's files go back."""
    hydra = tmp_path / ".hydra"
    segment = hydra / "segments" / "from_step_0"
    segment.mkdir(parents=True)
    later = hydra / "segments" / "from_step_10"
    later.mkdir()
    for name in resume_contract.HYDRA_FILES:
        (segment / name).write_text(f"first segment {name}\n")
        (later / name).write_text(f"second segment {name}\n")
        (hydra / name).write_text(f"refused run {name}\n")
    monkeypatch.setattr(resume_contract, "hydra_dir", lambda: hydra)
    with pytest.raises(ResumeRefused), resume_contract.holding(tmp_path):
        raise ResumeRefused("refused")
    for name in resume_contract.HYDRA_FILES:
        assert (hydra / name).read_text() == f"second segment {name}\n"


def test_auto_precision_continues_in_what_the_checkpoints_run_resolved(compose, tiny_overrides, tmp_path,
                                                                      monkeypatch, capsys) -> None:
    """A run started under ``auto`` where bfloat16 is native (bf16-mixed) and resumed where it is not (auto
    would pick fp32) stays in bf16-mixed; ``auto`` and the recorded precision are the same setting, any other
    precision is refused."""
    auto = [*tiny_overrides(None), *BASE, "trainer.precision=auto"]
    run_dir = tmp_path / "run"
    monkeypatch.setattr("rlhf_lab.runtime.precision.fast_bf16", lambda device: True)
    Trainer(compose(auto), run_dir).train()
    step_2 = run_dir / "checkpoints" / "step_2"
    assert json.loads((step_2 / "trainer_state.json").read_text())["precision"] == "bf16-mixed"

    monkeypatch.setattr("rlhf_lab.runtime.precision.fast_bf16", lambda device: False)
    capsys.readouterr()
    trainer = Trainer(compose([*auto, "trainer.resume=auto", "trainer.steps=3"]), run_dir)
    assert trainer.precision.name == "bf16-mixed"
    assert trainer.updater.precision is trainer.precision and trainer.experience.precision is trainer.precision
    assert ("trainer.precision=auto: continuing in bf16-mixed, what it resolved to for the run up to step_2 (auto "
            "picks fp32 on this machine; a run keeps its precision across resumes)") in capsys.readouterr().out
    trainer.train()
    assert json.loads((run_dir / "summary.json").read_text())["precision"] == "bf16-mixed"

    explicit = [*tiny_overrides(None), *BASE, "trainer.steps=3"]
    assert check_changes(compose([*explicit, "trainer.precision=bf16-mixed"]), step_2) == {"trainer.steps": (2, 3)}
    with pytest.raises(ResumeRefused, match=r"cannot change trainer.precision: auto -> fp32 .* resume with "
                                            r"trainer.precision=auto,"):
        check_changes(compose([*explicit, "trainer.precision=fp32"]), step_2)


def test_auto_precision_without_a_record_or_when_set_explicitly_is_left_alone(tmp_path, monkeypatch) -> None:
    from omegaconf import OmegaConf

    from rlhf_lab.runtime.precision import Precision

    folder = tmp_path / "step_4"
    folder.mkdir()
    here = Precision("fp32", "cpu")

    def continued(precision: str, state: dict) -> str:
        (folder / "trainer_state.json").write_text(json.dumps({"step": 4, **state}))
        cfg = OmegaConf.create({"trainer": {"precision": precision, "dtype": None}})
        return resume_contract.continued_precision(cfg, folder, here, announce=False).name

    assert continued("auto", {"precision": "bf16-mixed"}) == "bf16-mixed"
    assert continued("auto", {}) == "fp32"  # a checkpoint from before precisions were recorded: auto afresh
    assert continued("fp32", {"precision": "bf16-mixed"}) == "fp32"  # explicit: check_changes' business
    assert resume_contract.continued_precision(OmegaConf.create({"trainer": {"precision": "auto", "dtype": None}}),
                                               None, here) is here  # a fresh run
