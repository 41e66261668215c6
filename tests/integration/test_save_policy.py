"""``trainer.save=all|model|none``: what each checkpoint holds, what it can do, and the disk check before training."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lab.errors import CheckpointError, ConfigError
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training import save_policy
from rlhf_lab.training.loop import Trainer
from tests.limits import HANG_GUARD_S

pytestmark = pytest.mark.integration


def train(compose, tiny_overrides, tmp_path: Path, *overrides: str) -> tuple[Trainer, dict]:
    trainer = Trainer(compose([*tiny_overrides(tmp_path), *overrides]), tmp_path / "run")
    return trainer, trainer.train()


def test_save_model_writes_no_optimizer_state_and_refuses_to_resume(compose, tiny_overrides, tmp_path, run_cli):
    trainer, summary = train(compose, tiny_overrides, tmp_path, "trainer.save=model")
    assert summary["save"] == "model"
    folder = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert folder is not None and folder.name == "step_2"
    state = ckpt.read_state(folder)
    assert state["optimizer_saved"] is False
    assert "optimizer" not in state["optimizer"]  # the scheduler only
    assert load_file(str(folder / ckpt.OPTIMIZER_FILE)) == {}  # AdamW's moments are the only tensors it would hold
    # The model is there, whole: it loads into a fresh policy and equals the trained one.
    fresh = Trainer(compose([*tiny_overrides(tmp_path / "other")]), tmp_path / "other" / "run").models.policy
    ckpt.load_policy_weights(folder, fresh, uses_adapter=False)
    for (name, trained), loaded in zip(trainer.models.policy.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(trained, loaded), name
    with pytest.raises(CheckpointError, match="holds the model only .*trainer.save=model.*cannot resume"):
        Trainer(compose([*tiny_overrides(tmp_path), "trainer.resume=auto"]), tmp_path / "run")
    # It evaluates and exports as a full checkpoint does.
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {line}\n" for line in tiny_overrides(None)))
    code, _, err = run_cli(["eval", str(tmp_path / "run"), "eval.prompts=2", "--out", str(tmp_path / "eval")])
    assert code == 0, err
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["step"] == 2
    code, _, err = run_cli(["export", str(tmp_path / "run"), str(tmp_path / "exported")])
    assert code == 0, err
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_save_all_keeps_the_optimizer_and_none_writes_no_checkpoint_but_the_summary(compose, tiny_overrides,
                                                                                   tmp_path):
    _, summary = train(compose, tiny_overrides, tmp_path / "all", "trainer.save=all")
    folder = ckpt.latest_checkpoint(tmp_path / "all" / "run" / "checkpoints")
    assert summary["save"] == "all" and ckpt.read_state(folder)["optimizer_saved"] is True
    assert len(load_file(str(folder / ckpt.OPTIMIZER_FILE))) > 0

    _, summary = train(compose, tiny_overrides, tmp_path / "none", "trainer.save=none", "trainer.checkpoint_every=1")
    run = tmp_path / "none" / "run"
    assert not (run / "checkpoints").exists()
    assert json.loads((run / "summary.json").read_text())["save"] == "none" == summary["save"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2


def test_summary_and_final_evaluation_are_written_before_the_final_save(compose, tiny_overrides, tmp_path,
                                                                       monkeypatch):
    """A final save that fails (a full disk) leaves the run's results: the final evaluation and summary.json."""

    def full_disk(*args, **kwargs):
        raise CheckpointError("checkpoint at step 2 not written: no space left on device")

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
    with pytest.raises(CheckpointError, match="no space left"):
        train(compose, tiny_overrides, tmp_path, "trainer.save=all")
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval/reward/mean" in json.dumps(summary)
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 2 and "eval/reward/mean" in final


def test_auto_is_all_for_a_run_and_model_in_a_sweep(compose, tiny_overrides):
    trainer = compose(tiny_overrides(None)).trainer
    assert trainer.save == "auto"
    assert save_policy.resolve_save(trainer, sweep=False) == "all"
    assert save_policy.resolve_save(trainer, sweep=True) == "model"
    assert save_policy.resolve_save(compose([*tiny_overrides(None), "trainer.save=all"]).trainer, sweep=True) == "all"
    with pytest.raises(ConfigError, match=r"trainer.save='modle' is not valid; did you mean 'model'\? choose from: auto, all, "
                                         r"model, none"):
        compose([*tiny_overrides(None), "trainer.save=modle"])


def test_checkpoint_size_counts_weights_moments_and_checkpoints_on_disk(compose, tiny_overrides):
    trainer = compose([*tiny_overrides(None), "trainer.steps=10", "trainer.checkpoint_every=3",
                       "trainer.keep_last_n=2"]).trainer
    assert save_policy.saves_in_run(trainer) == 4  # after 3, 6, 9 updates and at the end (10)
    policy = torch.nn.Linear(10, 10)  # 110 float32 weights: 440 bytes
    head = torch.nn.Linear(10, 1)  # 11 weights: 44 bytes
    size = save_policy.checkpoint_size(trainer, policy, {"value_head": head}, False, "all")
    assert (size.model, size.optimizer, size.at_once) == (484, 2 * 484, 3)  # keep_last_n + the one being written
    assert size.total == 3 * 3 * 484
    assert save_policy.checkpoint_size(trainer, policy, {}, False, "model").optimizer == 0
    assert save_policy.checkpoint_size(trainer, policy, {}, False, "none").total == 0


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_training(compose, tiny_overrides, tmp_path,
                                                                     monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"checkpoints need about .* GB \(1 × .*model .*optimizer .*"
                                              r"has 1e-06 GB free; set trainer.save=model"):
        Trainer(compose([*tiny_overrides(tmp_path), "trainer.save=all"]), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
    Trainer(compose([*tiny_overrides(tmp_path / "none"), "trainer.save=none"]), tmp_path / "none" / "run")


def test_a_sharded_run_saves_the_whole_model_only(tmp_path):
    """Under FSDP ``trainer.save=model`` gathers the whole weights (no DCP shards, no optimizer): the same model an
    unsharded run writes."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "OMP_NUM_THREADS": "1"}
    common = ["model=tiny", "trainer.precision=fp32", "trainer.steps=2", "trainer.prompts_per_step=2",
              "algorithm.group_size=2", "trainer.max_new_tokens=4", "trainer.eval_prompts=0", "trainer.num_threads=1",
              "trainer.progress_bar=false", "trainer.save=model"]
    folders = {}
    for strategy in ("single", "fsdp"):
        folders[strategy] = tmp_path / strategy
        done = subprocess.run([sys.executable, "-m", "rlhf_lab", *common, f"trainer.strategy={strategy}",
                               f"trainer.output_dir={folders[strategy]}"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=HANG_GUARD_S)
        assert done.returncode == 0, done.stderr[-2000:]
    step = {name: folder / "checkpoints" / "step_2" for name, folder in folders.items()}
    assert not (step["fsdp"] / ckpt.SHARDED_FOLDER).exists() and ckpt.read_state(step["fsdp"])["optimizer_saved"] is False
    plain, sharded = (load_file(str(step[name] / "model" / "model.safetensors")) for name in ("single", "fsdp"))
    assert plain.keys() == sharded.keys()
    for name in plain:
        torch.testing.assert_close(sharded[name], plain[name], rtol=0, atol=1e-5)


def test_a_model_only_checkpoint_of_shards_says_to_export_before_starting_from_it(tmp_path: Path) -> None:
    """An FSDP checkpoint under trainer.save=model holds DCP shards and no ``model/``: the refusal names the export
    that makes a starting folder, where an unsharded one names its ``model/``."""
    from rlhf_lab.training.checkpoint_find import MODEL_FOLDER, refuse_model_only

    with pytest.raises(CheckpointError, match=rf"rlhf-lab export {tmp_path} OUT, then model=path"):
        refuse_model_only(tmp_path, {"optimizer_saved": False})
    (tmp_path / MODEL_FOLDER).mkdir()
    with pytest.raises(CheckpointError, match=rf"model.name_or_path={tmp_path / MODEL_FOLDER}\)"):
        refuse_model_only(tmp_path, {"optimizer_saved": False})
