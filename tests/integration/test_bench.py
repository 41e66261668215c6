"""``rlhf-lab bench``: the JSON it promises from a real (tiny) run, one-line argument errors, the TRL mapping.

The end-to-end run goes through ``benchmarks.bench.main`` as the command line does, so the measured run
happens in a child process and its peak RSS comes back from there. The TRL tests skip when TRL is not
installed (it is an optional extra: ``pip install -r requirements-trl.txt``).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import pytest

from benchmarks import bench
from benchmarks.bench_trl import PHASES as TRL_PHASES
from benchmarks.bench_trl import grpo_config_kwargs, unsupported_reason
from rlhf_lab.runtime.versions import cpu_name

TINY = ["model=tiny", "algorithm.group_size=4", "trainer.max_new_tokens=8", "trainer.num_threads=1"]


@pytest.fixture(scope="module", autouse=True)
def _the_process_environment_as_it_was():
    """Importing TRL sets ``VLLM_LOGGING_LEVEL=ERROR`` in the process environment (its default for vLLM): after this
    module it is put back, so a vLLM engine a later test of the same worker builds logs at vLLM's own level."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("bench") / "report.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        bench.main(["--steps", "2", "--warmup", "1", "--json", str(path), "--", *TINY])
    return json.loads(path.read_text()), stdout.getvalue()


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_tiny_run_reports_every_promised_field(tiny_report: tuple[dict, str]) -> None:
    report, _ = tiny_report
    assert report["schema"] == bench.SCHEMA
    assert report["settings"]["steps"] == 2 and report["settings"]["warmup"] == 1
    (row,) = report["rows"]
    assert row["row"] == "grpo_full" and "kl.coef=0.04" in row["overrides"]
    entry = row["frameworks"]["rlhf_lab"]
    summary, (run,) = entry["summary"], entry["runs"]
    assert summary["measured_steps"] == 2 and len(run["records"]) == 2 and len(run["warmup_records"]) == 1
    for key in ("step_s_median", "step_s_mean", "tokens_per_s", "peak_rss_mib", "setup_s_median"):
        assert _positive(summary[key]), key
    assert set(summary["phases_s_mean"]) == set(bench.PHASES) == set(TRL_PHASES)
    for name in ("generate", "reference", "policy_forward_backward", "optimizer"):
        assert _positive(summary["phases_s_mean"][name]), name
    assert all(v >= 0 for v in summary["phases_s_mean"].values())
    assert sum(summary["phases_s_mean"].values()) <= summary["step_s_mean"] + 1e-9
    assert summary["other_s_mean"] >= -1e-9
    for record in run["records"]:
        assert sum(record["phases"].values()) <= record["step_s"] + 1e-9
        assert record["tokens"] > 0
    assert isinstance(summary["reward_mean"], float) and -1.0 <= summary["reward_mean"] <= 1.0
    assert summary["peak_rss_mib"] > 100  # a child that loaded torch and a model, in MiB
    assert "trl" not in row["frameworks"] and report["scaling"] == []
    # What the run's figures were measured with, from the child that measured them.
    assert run["versions"] == {"torch": version("torch"), "transformers": version("transformers"),
                               "peft": version("peft"), "attention": "sdpa", "device": cpu_name()}


def test_tiny_run_prints_table_and_json(tiny_report: tuple[dict, str]) -> None:
    report, stdout = tiny_report
    table, _, json_text = stdout.partition("\n{")
    assert "grpo_full  rlhf_lab" in table and "peak RSS MiB" in table
    assert json.loads("{" + json_text) == report


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "--steps=0 is out of range"),
        (["--steps", "two"], "invalid int value"),
        (["--compare", "verl"], "invalid choice"),
        (["--frobnicate"], "unrecognized argument '--frobnicate'"),
        (["--batch-sizes", "4,x"], "comma-separated list of integers"),
        (["--seeds", "0,-1"], "'0,-1' must list integers >= 0"),
        (["--", "algorithm=nope"], "algorithm='nope' is not an option"),
        (["--", "trainer.stepz=3"], "trainer.stepz"),
    ],
)
def test_argument_errors_are_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_merge_and_scaling_overrides() -> None:
    assert bench.merge_overrides(["a=1", "b=2"], ["+a=3", "c=4"]) == ["+a=3", "b=2", "c=4"]
    assert bench.scaling_overrides(4, 16) == ["trainer.prompts_per_step=1", "algorithm.group_size=4",
                                              "trainer.max_new_tokens=16"]
    assert bench.scaling_overrides(16, 32)[:2] == ["trainer.prompts_per_step=2", "algorithm.group_size=8"]
    assert bench.scaling_overrides(32, 64)[:2] == ["trainer.prompts_per_step=4", "algorithm.group_size=8"]


def test_seeds_cycle_over_rounds_and_rewards_pool_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--seeds gives round r seeds[r % len]; each run's mean reward is kept, with their spread."""
    jobs = []

    def fake_run(job: bench.Job, work_dir: Path, label: str) -> dict:
        jobs.append(job)
        seed = int(next(o for o in job.overrides if o.startswith("seed="))[5:])
        records = [{"step_s": 1.0, "phases": dict.fromkeys(bench.PHASES, 0.1), "tokens": 10, "reward_mean": r}
                   for r in (seed, seed + 1.0)]  # run mean = seed + 0.5
        return {"records": records, "peak_rss_mib": 100.0, "setup_s": 1.0}

    monkeypatch.setattr(bench, "_run_and_report", fake_run)
    report = bench.run_benchmark(bench.parse_args(["--rounds", "3", "--seeds", "4,7", "--", *TINY]))
    assert [o for job in jobs for o in job.overrides if o.startswith("seed=")] == ["seed=4", "seed=7", "seed=4"]
    assert report["settings"]["seeds"] == [4, 7]
    summary = report["rows"][0]["frameworks"]["rlhf_lab"]["summary"]
    assert summary["reward_mean_per_run"] == [4.5, 7.5, 4.5]
    assert summary["reward_mean"] == pytest.approx(5.5)
    assert summary["reward_mean_sd_over_runs"] == pytest.approx(math.sqrt(3.0))  # sample sd of 4.5, 7.5, 4.5
    assert "5.500 ± 1.732 (3 runs)" in bench.format_report(report)


@pytest.mark.parametrize(("extra", "fast", "expected"), [
    ([], True, "trainer.precision=bf16-mixed"), ([], False, "trainer.precision=fp32"),
    (["trainer.precision=fp32"], True, "trainer.precision=fp32"),
    (["trainer.precision=bf16-true"], False, "trainer.precision=bf16-true")])
def test_auto_precision_is_resolved_once_for_every_child(monkeypatch: pytest.MonkeyPatch, extra: list[str],
                                                         fast: bool, expected: str) -> None:
    """``auto`` measures the CPU's products: the parent resolves it once and every child (both frameworks, every
    round) gets the answer written out; an explicit precision is passed on as it is."""
    jobs = []

    def fake_run(job: bench.Job, work_dir: Path, label: str) -> dict:
        jobs.append(job)
        return {"records": [{"step_s": 1.0, "phases": dict.fromkeys(bench.PHASES, 0.1), "tokens": 10,
                             "reward_mean": 0.0}], "peak_rss_mib": 100.0, "setup_s": 1.0}

    monkeypatch.setattr(bench, "_run_and_report", fake_run)
    monkeypatch.setattr("rlhf_lab.runtime.precision.fast_bf16", lambda device: fast)
    bench.run_benchmark(bench.parse_args(["--rounds", "2", "--", *TINY, *extra]))
    assert len(jobs) == 2
    assert all([o for o in job.overrides if o.startswith("trainer.precision=")] == [expected] for job in jobs)


def test_format_report_shows_ratio_skips_and_scaling() -> None:
    summary = {"step_s_median": 2.0, "phases_s_mean": dict.fromkeys(bench.PHASES, 0.1), "other_s_mean": 0.4,
               "tokens_per_s": 100.0, "peak_rss_mib": 1000.0, "reward_mean": 0.1}
    report = {
        "rows": [
            {"row": "grpo_full", "frameworks": {"rlhf_lab": {"summary": summary}, "trl": {"summary": summary}},
             "ratio_rlhf_lab_over_trl": {"step_s_median": 1.0, "peak_rss_mib": 1.0}},
            {"row": "ppo_full", "frameworks": {"rlhf_lab": {"summary": summary}, "trl": {"skipped": "no PPO"}}},
        ],
        "scaling": [{"samples": 4, "prompts_per_step": 1, "group_size": 4, "max_new_tokens": 16, "summary": summary}],
    }
    text = bench.format_report(report)
    assert "rlhf_lab / trl = 1.00x time per step" in text
    assert "ppo_full trl: not run: no PPO" in text
    assert "4 (1x4)" in text and "2.00 s, 100 tok/s, 1000 MiB" in text


def test_trl_settings_match_the_config(compose) -> None:
    cfg = compose(["trainer.prompts_per_step=2", "algorithm.group_size=8", "kl=k3", "kl.coef=0.04"])
    kwargs = grpo_config_kwargs(cfg, total_steps=3, output_dir="/tmp/unused")
    assert kwargs["per_device_train_batch_size"] == 16 and kwargs["gradient_accumulation_steps"] == 1
    assert kwargs["num_generations"] == 8 and kwargs["max_completion_length"] == 32
    assert kwargs["beta"] == 0.04 and kwargs["loss_type"] == "dapo" and kwargs["scale_rewards"] == "group"
    assert kwargs["learning_rate"] == cfg.trainer.lr and kwargs["lr_scheduler_type"] == "constant"
    assert kwargs["temperature"] == cfg.trainer.temperature and kwargs["top_p"] == cfg.trainer.top_p
    assert not kwargs["activation_checkpointing"] and kwargs["optim"] == "adamw_torch_fused"
    assert kwargs["report_to"] == "none" and kwargs["save_strategy"] == "no" and kwargs["eval_strategy"] == "no"
    # Precision: TRL's bf16 autocast exactly when rlhf_lab runs bf16-mixed (also what auto resolves to on bf16
    # hardware); the weights in the dtype rlhf_lab keeps them in.
    for precision, bf16, dtype in [("fp32", False, "float32"), ("bf16-mixed", True, "float32"),
                                   ("bf16-true", False, "bfloat16")]:
        kwargs = grpo_config_kwargs(compose([f"trainer.precision={precision}"]), total_steps=3, output_dir="/tmp/x")
        assert kwargs["bf16"] is bf16 and kwargs["model_init_kwargs"] == {"dtype": dtype}


@pytest.mark.extra("trl")
def test_trl_rejects_settings_it_cannot_match(compose) -> None:
    assert unsupported_reason(compose(["algorithm=grpo"])) is None
    assert "rloo" in unsupported_reason(compose(["algorithm=rloo"]))
    assert "PPO" in unsupported_reason(compose(["algorithm=ppo"]))
    assert "k3" in unsupported_reason(compose(["kl=mse"]))


@pytest.mark.extra("trl")
def test_trl_runner_does_one_step_on_a_tiny_model(tmp_path: Path, compose) -> None:
    from benchmarks.bench_trl import run_trl
    from rlhf_lab.models.loading import build_tiny_llama, load_tokenizer

    tiny_cfg = compose(["model=tiny"])
    tokenizer = load_tokenizer(tiny_cfg.model)
    folder = tmp_path / "tiny_llama"
    build_tiny_llama(tokenizer, tiny_cfg.model.tiny, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = compose(["model=path", f"model.name_or_path={folder}", "algorithm.group_size=2", "trainer.max_new_tokens=4",
                   "trainer.num_threads=1", "trainer.device=cpu"])
    records, facts = run_trl(cfg, steps=1, warmup=0, work_dir=tmp_path / "work")
    (record,) = records
    assert 0 < record["step_s"] < 60
    assert set(record["phases"]) == set(TRL_PHASES) and sum(record["phases"].values()) <= record["step_s"] + 1e-9
    assert record["tokens"] > 0 and math.isfinite(record["reward_mean"])
    assert facts["prompt_ids_match"] and facts["trainer"] == "trl.GRPOTrainer"


def test_rlhf_lab_bench_runs_the_checkouts_benchmarks(capsys: pytest.CaptureFixture) -> None:
    from rlhf_lab.app import bench_command

    with pytest.raises(SystemExit) as stopped:
        bench_command.main(["--steps", "0"])  # benchmarks.bench's own argument check answers
    assert stopped.value.code == 2 and capsys.readouterr().err.strip() == "error: --steps=0 is out of range; must be >= 1"


def test_rlhf_lab_bench_without_the_repository_says_what_to_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    from rlhf_lab.app import bench_command

    monkeypatch.setattr(bench_command, "REPOSITORY", tmp_path)  # an installed package: no benchmarks/ beside it
    with pytest.raises(SystemExit) as stopped:
        bench_command.main(["--compare", "trl"])
    (line,) = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line == f"error: {bench_command.NOT_SHIPPED}" and "make bench" in line


def test_the_weight_sync_canary_s_share_of_a_step_is_reported() -> None:
    """A vLLM row's canary (``time/sync_check_s``, timed inside generation): its mean per step and its share of the
    mean step, as a note under the table; rows without one (hf) get no note."""
    records = [{"step_s": step_s, "phases": dict.fromkeys(bench.PHASES, 0.1), "tokens": 10, "reward_mean": 0.0,
                "sync_check_s": canary} for step_s, canary in ((2.0, 0.02), (4.0, 0.04))]
    summary = bench.summarize([{"records": records, "peak_rss_mib": 100.0, "setup_s": 1.0}])
    assert summary["sync_check_s_mean"] == pytest.approx(0.03) and summary["step_s_mean"] == pytest.approx(3.0)
    plain = bench.summarize([{"records": [{k: v for k, v in r.items() if k != "sync_check_s"} for r in records],
                              "peak_rss_mib": 100.0, "setup_s": 1.0}])
    assert plain["sync_check_s_mean"] == 0.0
    report = {"rows": [{"row": "grpo_full_vllm", "frameworks": {"rlhf_lab": {"summary": summary}}},
                       {"row": "grpo_full", "frameworks": {"rlhf_lab": {"summary": plain}}}], "scaling": []}
    text = bench.format_report(report)
    assert "grpo_full_vllm: weight-sync canary 0.030 s per step (1.0% of the mean step; inside 'generate')" in text
    assert "grpo_full: weight-sync" not in text


def test_a_gpu_row_reports_its_peak_memory_and_median_mfu() -> None:
    """On a GPU each row notes the allocator's peak (the largest of its runs) and the median step's MFU; a CPU row
    (no GPU peak, no MFU) gets no such note."""
    records = [{"step_s": 1.0, "phases": dict.fromkeys(bench.PHASES, 0.1), "tokens": 10, "reward_mean": 0.0,
                "mfu": mfu} for mfu in (0.10, 0.30, 0.20)]
    summary = bench.summarize([{"records": records[:2], "peak_rss_mib": 100.0, "peak_gpu_mib": 2048.0},
                               {"records": records[2:], "peak_rss_mib": 100.0, "peak_gpu_mib": 4096.0}])
    assert summary["peak_gpu_mib"] == 4096.0 and summary["mfu_median"] == pytest.approx(0.20)
    cpu = bench.summarize([{"records": [{**r, "mfu": None} for r in records], "peak_rss_mib": 100.0,
                            "peak_gpu_mib": None}])
    assert cpu["peak_gpu_mib"] is None and cpu["mfu_median"] is None
    report = {"rows": [{"row": "grpo_full", "frameworks": {"rlhf_lab": {"summary": summary}}},
                       {"row": "grpo_lora", "frameworks": {"rlhf_lab": {"summary": cpu}}}], "scaling": []}
    text = bench.format_report(report)
    assert "grpo_full: peak GPU memory 4096 MiB (allocator), MFU 20.0% (median step)" in text
    assert "grpo_lora: peak GPU" not in text
