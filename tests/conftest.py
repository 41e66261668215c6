"""Shared test setup: offline environment, config composition as the CLI does it, fast run settings.

The environment variables are set at import, before any test module imports torch, transformers or wandb,
so no test touches the network or prompts for a W&B login. Torch runs one intra-op thread, here and in
every subprocess a test starts (``OMP_NUM_THREADS``): on this shared 2-core machine, when other jobs keep
the cores busy, two threads spin-wait on each other and a run takes 3-4 times as long (measured: the
SmolLM2 smoke run took 47 s with one thread and 172 s with two under the same load).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["OMP_NUM_THREADS"] = "1"

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

torch.set_num_threads(1)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def compose(overrides: list[str]) -> DictConfig:
    """The config a job gets from ``overrides``: :func:`rlhf_lab.config.compose`, as the CLI does it.

    Typos, unknown options, wrong types and out-of-range values raise a one-line
    :class:`rlhf_lab.errors.ConfigError` here as on the command line.
    """
    from rlhf_lab.config import compose as compose_config

    return compose_config(list(overrides))


def tiny_overrides(tmp_path: Path | None) -> list[str]:
    """Settings for a run of a few seconds on the tiny random Llama.

    With ``tmp_path`` the run writes to ``tmp_path/run``; with None no ``trainer.output_dir`` is set (a
    Hydra sweep, where each job uses its own run folder).
    """
    overrides = [
        "model=tiny",
        "trainer.precision=fp32",  # exact comparisons; the default (auto) picks bf16-mixed on bf16 hardware
        "trainer.steps=2",
        "trainer.prompts_per_step=2",
        "algorithm.group_size=2",
        "trainer.max_new_tokens=4",
        "trainer.eval_prompts=2",
        "trainer.progress_bar=false",
        "trainer.num_threads=1",
    ]
    if tmp_path is not None:
        overrides.append(f"trainer.output_dir={Path(tmp_path) / 'run'}")
    return overrides


SCORED_PROMPT, SCORED_RESPONSE, SCORED_GROUP = 5, 4, 3  # the shape of scoring_batch()


def scoring_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A scoring pass's batch over token ids 3..vocab−1: two prompts of SCORED_PROMPT tokens with SCORED_GROUP
    sampled rows each (the pass shares each prompt's prefill), SCORED_RESPONSE response tokens per row, and the
    first prompt left-padded by one position (a padding mask). Returns (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(0)
    rows = 2 * SCORED_GROUP
    prompts = torch.randint(3, vocab, (2, SCORED_PROMPT), generator=generator).repeat_interleave(SCORED_GROUP, dim=0)
    responses = torch.randint(3, vocab, (rows, SCORED_RESPONSE), generator=generator)
    mask = torch.ones(rows, SCORED_PROMPT + SCORED_RESPONSE, dtype=torch.long)
    mask[:SCORED_GROUP, 0] = 0
    return torch.cat([prompts, responses], dim=1), mask


# The optional extras a test may need (``@pytest.mark.extra("vllm")``): the module whose presence says the extra is
# installed, and the command that installs it. ``make test`` (no extra) skips such a test with that command as the
# reason; ``make test-extras`` installs every extra and runs exactly these tests (``-m extra``).
EXTRAS = {
    "vllm": ("vllm", "make install-vllm"),
    "reasoning": ("reasoning_gym", "make install-reasoning"),
    "mlflow": ("mlflow", "make install-mlflow"),
    "openai": ("openai", "make install-openai"),
    "trackio": ("trackio", "make install-trackio"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "make install-ray"),
    "trl": ("trl", "make install-trl"),
    "verifiers": ("verifiers", "make install-verifiers, then .venv-verifiers/bin/python -m pytest"),
}


def extra_installed(name: str) -> bool:
    """Whether the optional extra ``name`` (a key of :data:`EXTRAS`) is installed in this Python."""
    try:
        return importlib.util.find_spec(EXTRAS[name][0]) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs the embedded SmolLM2 model (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "integration: runs, CLI processes, sweeps (every test under tests/integration)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; make test-gpu), skipped elsewhere")
    config.addinivalue_line("markers", f"extra(name): needs the optional extra name (one of {', '.join(EXTRAS)}); "
                                       "skipped with its install command where it is absent, run by make test-extras")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under ``tests/integration/`` so ``-m 'not integration'`` is the fast unit run, and skip a test
    whose optional extra is absent, naming the command that installs it."""
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
        for marker in item.iter_markers("extra"):
            (name,) = marker.args
            if name not in EXTRAS:
                raise pytest.UsageError(f"{item.nodeid}: extra({name!r}) is not an extra; choose from: "
                                        f"{', '.join(EXTRAS)}")
            if not extra_installed(name):
                item.add_marker(pytest.mark.skip(reason=f"needs the optional {name} extra: {EXTRAS[name][1]}"))


@pytest.fixture(autouse=True, scope="session")
def temporary_files_in_the_test_run() -> Iterator[None]:
    """Every temporary file of the run, the processes' it starts included (torchrun's ``torchelastic_*`` log folders,
    compile caches, exported models), goes into one folder of the test process's (``TMPDIR``), removed as the session
    ends: never left loose in ``/tmp``. A short path of its own (Ray's socket paths must stay under 108 bytes)."""
    folder = tempfile.mkdtemp(prefix="rlhf_lab_tests_")
    before, cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, None
    yield
    tempfile.tempdir = cached
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def own_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test runs in a fresh folder of its own: what a run, a sweep or a search writes under ``outputs/``
    (Hydra's run folders, an Optuna study's database) never reaches another test or the user's ``outputs/``, and no
    test reads what an earlier command left there."""
    folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """No log file of a test's is written after it: an in-process command leaves Hydra's job-log handler on the root
    logger (a process that runs one command ends there), and an engine a test does not close leaves its routing of
    vLLM's lines to that file; a later test's lines would go to a folder that is gone. Both are taken off."""
    from rlhf_lab.generation.vllm_logs import VLLM_LOGGER, _ToFiles

    root, vllm = logging.getLogger(), logging.getLogger(VLLM_LOGGER)
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler) and h not in before]:
        root.removeHandler(handler)
        handler.close()
    for handler in [h for h in vllm.handlers if isinstance(h, _ToFiles)]:
        vllm.removeHandler(handler)


@pytest.fixture(name="compose", scope="session")
def compose_fixture() -> Callable[[list[str]], DictConfig]:
    return compose


@pytest.fixture(name="tiny_overrides", scope="session")
def tiny_overrides_fixture() -> Callable[[Path | None], list[str]]:
    return tiny_overrides


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tokenizer of ``model=tiny`` (the embedded one), loaded once per test process."""
    from rlhf_lab.models.loading import load_tokenizer

    return load_tokenizer(compose(tiny_overrides(None)).model)


@pytest.fixture(name="run_cli")
def run_cli_fixture(capsys) -> Callable[[list[str]], tuple[int, str, str]]:
    """``rlhf-lab ARGS`` in-process: (exit status, stdout, stderr)."""

    def run_cli(args: list[str]) -> tuple[int, str, str]:
        from rlhf_lab.app.cli import main

        code = 0
        try:
            main(args)
        except SystemExit as stop:
            code = int(stop.code or 0)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run_cli

