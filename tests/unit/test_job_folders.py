"""Job folder labels (rlhf_lab/app/job_folders.py): short, bounded, distinct, the swept keys only when known."""

from __future__ import annotations

from omegaconf import OmegaConf

from rlhf_lab.app.job_folders import LABEL_CHARS, job_label, swept_keys


def test_group_choices_by_value_and_dotted_keys_by_their_last_part() -> None:
    assert job_label("kl=k3,kl.placement=loss,seed=1") == "k3,placement=loss,seed=1"


def test_only_swept_keys_when_known() -> None:
    label = job_label("model=tiny,kl=k3,trainer.steps=1,seed=2", frozenset({"kl", "seed"}))
    assert label == "k3,seed=2"


def test_long_labels_are_bounded_and_stay_distinct() -> None:
    base = ",".join(f"trainer.key_number_{i}=value_{i}" for i in range(20))
    first, second = job_label(base + ",seed=0"), job_label(base + ",seed=1")
    assert len(first) <= LABEL_CHARS and len(second) <= LABEL_CHARS
    assert first != second


def test_unsafe_characters_become_dashes() -> None:
    assert "/" not in job_label("data.path=/tmp/a b/c.jsonl")


def test_swept_keys_from_multirun_yaml(tmp_path) -> None:
    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": ["model=tiny", "seed=0,1"]},
                                               "sweeper": {"params": {"kl": "k3,kl"}}}}), tmp_path / "multirun.yaml")
    assert swept_keys(str(tmp_path)) == frozenset({"seed", "kl"})
    assert swept_keys(str(tmp_path / "missing")) is None
