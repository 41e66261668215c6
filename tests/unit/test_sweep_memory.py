"""A sweep job whose weights, gradients, optimizer state and reference alone exceed the memory available is refused
when the sweep is composed, in the memory check's words, naming the job, before any job starts
(rlhf_lab/training/sweep_memory.py, the check ``rlhf-lab`` passes to compose). The memory available is patched; model=tiny made wide (hidden 1024: 57,414,656
parameters, 0.214 GiB in float32) holds more than it.

A sweep that fits, a check turned off, memory that cannot be read, one run, a launcher whose jobs run on other machines and a
model that only a download could size are left as they were: the run-start check alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from rlhf_lab.app import cli
from rlhf_lab.config.compose import compose as compose_config
from rlhf_lab.errors import ConfigError
from rlhf_lab.training import memory_check
from rlhf_lab.training.sweep_memory import held_state_check

MIB = 1 << 20
WIDE = 57_414_656  # 49,152 x 1,024 (tied embeddings) + 2 x 3,540,992 per layer + 1,024 (the final norm)
TAIL = "or set trainer.skip_memory_check=true to start anyway"
FULL = "lower the model's size or train an adapter (model.lora.enabled=true)"

REFUSED = [  # (sweep, MiB available, the one line)
    (["model=tiny", "trainer.precision=fp32", "model.tiny.hidden_size=64,1024"], 256,
     "sweep job 1 of 2 (model=tiny trainer.precision=fp32 model.tiny.hidden_size=1024): this run needs about 1.95 GiB "
     "(weights 0.214, gradients 0.214, AdamW 0.428, reference 0.214, activations 0.879), this machine has 0.25 GiB "
     f"available on cpu; {FULL}, {TAIL}"),
    # joblib's workers run on this machine: the same refusal
    (["model=tiny", "trainer.precision=fp32", "model.tiny.hidden_size=64,1024", "hydra/launcher=joblib_local"], 256,
     "sweep job 1 of 2 (model=tiny trainer.precision=fp32 model.tiny.hidden_size=1024): this run needs about 1.95 GiB "
     "(weights 0.214, gradients 0.214, AdamW 0.428, reference 0.214, activations 0.879), this machine has 0.25 GiB "
     f"available on cpu; {FULL}, {TAIL}"),
    # precision=auto, measured when the run starts, is taken as bf16-mixed here: the reference in bfloat16
    (["model=tiny", "model.tiny.hidden_size=1024", "seed=0,1"], 256,
     "sweep job 0 of 2 (model=tiny model.tiny.hidden_size=1024 seed=0): this run needs about 1.4 GiB (weights 0.214, "
     "gradients 0.214, AdamW 0.428, reference 0.107, activations 0.439), this machine has 0.25 GiB available on cpu; "
     f"{FULL}, {TAIL}"),
    # LoRA: the adapter's gradients and moments, no reference copy
    (["model=tiny", "model.lora.enabled=true", "trainer.precision=fp32", "trainer.micro_batch_size=1",
      "model.tiny.hidden_size=64,1024"], 128,
     "sweep job 1 of 2 (model=tiny model.lora.enabled=True trainer.precision=fp32 trainer.micro_batch_size=1 "
     "model.tiny.hidden_size=1024): this run needs about 0.274 GiB (weights 0.215, gradients 0.00127, AdamW 0.00253, "
     "activations 0.0549), this machine has 0.125 GiB available on cpu; lower the model's size or model.lora.r, "
     f"{TAIL}"),
]


def compose(overrides: list[str]) -> DictConfig:
    """Composed as ``rlhf-lab`` composes a command line: each sweep job's held state checked."""
    return compose_config(overrides, check_job=held_state_check())


@pytest.fixture
def available(monkeypatch) -> Callable[[int | None], None]:
    def set_available(mib: int | None) -> None:
        monkeypatch.setattr(memory_check, "available_memory", lambda device: None if mib is None else mib * MIB)

    return set_available


@pytest.mark.parametrize(("sweep", "mib", "message"), REFUSED, ids=["fp32", "joblib", "auto", "lora"])
def test_a_job_whose_held_state_cannot_fit_is_refused_naming_it(sweep, mib, message, available) -> None:
    available(mib)
    with pytest.raises(ConfigError) as refused:
        compose(sweep)
    assert str(refused.value) == message


def test_the_wide_models_weights_are_counted_by_hand() -> None:
    assert f"{WIDE * 4 / (1 << 30):.3g}" == "0.214" and f"{WIDE * 2 / (1 << 30):.3g}" == "0.107"


PASSED = [  # (sweep, MiB available): composed as before; a job over the memory is left to its run's own check
    (["model=tiny", "trainer.precision=fp32", "model.tiny.hidden_size=64,128"], 256),  # every job fits
    (["model=tiny", "model.tiny.hidden_size=64,1024", "trainer.skip_memory_check=true"], 256),
    (["model=tiny", "model.tiny.hidden_size=64,1024"], None),  # the memory available cannot be read
    (["model=tiny", "model.tiny.hidden_size=1024"], 256),  # one run: refused when it starts, as before
    (["model=tiny", "model.tiny.hidden_size=64,1024", "hydra/launcher=slurm"], 256),  # jobs on other machines
    # held state (61 MiB) fits, activations do not: the run's planned step decides
    (["model=tiny", "trainer.precision=fp32", "trainer.micro_batch_size=64", "trainer.prompts_per_step=32",
      "algorithm.group_size=2", "seed=0,1"], 100),
]


@pytest.mark.parametrize(("sweep", "mib"), PASSED,
                         ids=["fits", "skipped", "unknown", "one_run", "slurm", "activations"])
def test_what_the_check_leaves_alone(sweep, mib, available) -> None:
    available(mib)
    assert compose(sweep).model.name == "tiny"


def write_cached_hub_model(cache: Path, repo: str, hidden_size: int) -> None:
    """A hub id in a Hugging Face cache folder, its config.json alone (what the check reads; no weights)."""
    from transformers import LlamaConfig

    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    LlamaConfig(vocab_size=49152, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True).to_json_file(
        snapshot / "config.json")


def test_a_hub_id_is_sized_from_the_cache_and_skipped_where_only_a_download_would_tell(tmp_path, monkeypatch,
                                                                                       available) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    write_cached_hub_model(tmp_path / "hub", "someorg/wide", 1024)
    available(256)
    with pytest.raises(ConfigError, match=r"^sweep job 0 of 2 \(model=path model\.name_or_path=someorg/wide "
                                          r"trainer\.precision=fp32 seed=0\): this run needs about .* \(weights 0\.214, "):
        compose(["model=path", "model.name_or_path=someorg/wide", "trainer.precision=fp32", "seed=0,1"])

    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # an id the cache does not hold passes validation when online
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *args, **kwargs: pytest.fail("read"))
    available(1)
    assert compose(["model=path", "model.name_or_path=someorg/uncached", "seed=0,1"]).model.name == "path"


def test_the_cli_starts_no_job_of_a_sweep_that_cannot_fit(run_cli, tmp_path, monkeypatch, available) -> None:
    launched: list[bool] = []
    monkeypatch.setattr(cli, "_hydra_entry", lambda: launched.append(True))  # Hydra's launcher: the jobs
    available(256)
    sweep = ["-m", *REFUSED[0][0], f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    code, _, err = run_cli(sweep)
    assert (code, err.splitlines()[-1], launched) == (2, f"error: {REFUSED[0][2]}", [])
    assert not (tmp_path / "sweep").exists()
    code, _, err = run_cli([*sweep[:-2], "model.tiny.hidden_size=64,128", sweep[-1]])  # the same sweep, fitting
    assert (code, launched) == (0, [True]), err
