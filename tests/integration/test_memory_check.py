"""A run whose memory estimate exceeds what the machine has stops in one line before its model is built;
``trainer.skip_memory_check=true`` starts it anyway. The available memory is patched to a few MiB."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_offline_stages import synthetic_pairs, write_jsonl

from rlhf_lab.errors import ConfigError
from rlhf_lab.offline import reward_trainer
from rlhf_lab.training import loop, memory_check
from rlhf_lab.training.launch import run

FEW_MIB = 4 << 20  # below the tiny model's estimate (about 0.1 GiB): weights alone are 12 MiB


@pytest.fixture
def little_memory(monkeypatch) -> None:
    monkeypatch.setattr(memory_check, "available_memory", lambda device: FEW_MIB)


def test_a_run_that_cannot_fit_stops_before_its_model_is_built(tiny_overrides, run_cli, tmp_path, monkeypatch,
                                                                little_memory) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_policy", never)
    code, _, err = run_cli(tiny_overrides(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: this run needs about ") and "this machine has 0.00391 GiB available on cpu" in err
    assert err.rstrip().endswith("or set trainer.skip_memory_check=true to start anyway")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_skip_memory_check_starts_the_run_anyway(tiny_overrides, run_cli, tmp_path, little_memory) -> None:
    code, _, err = run_cli([*tiny_overrides(tmp_path), "trainer.skip_memory_check=true"])
    assert code == 0, err
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_2"


def test_the_reward_model_stage_is_checked_too(compose, tiny_overrides, tmp_path, monkeypatch, little_memory) -> None:
    folder = tmp_path / "pairs"
    write_jsonl(folder / "train.jsonl", synthetic_pairs(8, seed=0))
    monkeypatch.setattr(reward_trainer, "build_reward_model", lambda *args: pytest.fail("the model was built"))
    cfg = compose([*tiny_overrides(tmp_path), "algorithm=reward_model", "data=preferences", f"data.path={folder}"])
    with pytest.raises(ConfigError, match=r"^this run needs about .* \(weights 0\.012, gradients 0\.012, AdamW "
                                          r"0\.024, activations [0-9.e-]+\), this machine has 0\.00391 GiB"):
        run(cfg, Path(cfg.trainer.output_dir))


def test_a_finished_run_frees_its_weights_even_from_a_reference_cycle(compose, tiny_overrides, tmp_path,
                                                                      monkeypatch) -> None:
    """The next job of an in-process sweep starts with the last one's memory free, whenever Python's cyclic
    collector would run: a trainer held in a reference cycle (as a first import during its construction leaves
    one) is freed when its run returns."""
    import gc
    import weakref

    held = []
    train = loop.Trainer.train

    def train_in_a_cycle(self):
        self.cycle = self  # freed only by the cyclic collector
        held.append(weakref.ref(next(self.models.policy.parameters())))
        return train(self)

    monkeypatch.setattr(loop.Trainer, "train", train_in_a_cycle)
    cfg = compose([*tiny_overrides(tmp_path), "trainer.steps=1"])
    enabled = gc.isenabled()
    gc.disable()
    try:
        run(cfg, tmp_path / "run")
        assert held and held[0]() is None
    finally:
        if enabled:
            gc.enable()
