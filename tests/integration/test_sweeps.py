"""Multirun sweeps: ``+experiment=smoke`` with W&B offline under the basic and the joblib launcher, the
experiment files and the launcher configs.

The sweeps run as users run them (``python -m rlhf_lab ...`` in a subprocess, ``model=tiny``); each runs
once per session (:func:`smoke_sweep`) and test_report.py reuses the basic one. W&B's offline run files are
read back with :func:`read_offline_run`, which decodes the run's ``.wandb`` transaction log.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.limits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
SMOKE_JOBS = ["algorithm=grpo,kl=k3", "algorithm=grpo,kl=kl", "algorithm=rloo,kl=k3", "algorithm=rloo,kl=kl"]
SMOKE_STEPS = 2


# ------------------------------------------------------------------------------------------ helpers


def wandb_test_env(root: Path) -> dict[str, str]:
    """The environment for a test run: offline, no credentials, every W&B folder under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HF_HUB_OFFLINE="1",
        NETRC=str(root / "no-netrc"),
        WANDB_CACHE_DIR=str(root / "wandb-cache"),
        WANDB_CONFIG_DIR=str(root / "wandb-config"),
        WANDB_DATA_DIR=str(root / "wandb-data"),
        WANDB_ARTIFACT_DIR=str(root / "wandb-artifacts"),
    )
    return env


@dataclass
class Sweep:
    folder: Path
    wall_s: float
    output: str

    def jobs(self) -> list[Path]:
        return sorted(
            (p for p in self.folder.iterdir() if p.is_dir() and p.name[0].isdigit()),
            key=lambda p: int(p.name.split("_")[0]),
        )


def swept(job: Path) -> str:
    """A job's swept overrides as W&B names its run (``algorithm=grpo,kl=k3``), from ``.hydra/overrides.yaml``
    (the folder name is the job number and a short label: ``0_grpo,k3``)."""
    lines = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    return ",".join(sorted(line for line in lines if line.split("=")[0] in ("algorithm", "kl")))


@functools.cache
def smoke_sweep(base: Path, launcher: str = "basic") -> Sweep:
    """Run ``rlhf-lab +experiment=smoke`` (W&B offline) once per session and launcher."""
    folder = base / f"smoke_{launcher}"
    command = [
        sys.executable,
        "-m",
        "rlhf_lab",
        "+experiment=smoke",
        "logger=wandb",
        "logger.mode=offline",
        f"hydra.sweep.dir={folder}",
    ]
    if launcher == "joblib":
        command += ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=base, env=wandb_test_env(base), capture_output=True, text=True, timeout=HANG_GUARD_S)
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Sweep(folder, wall, result.stdout + result.stderr)


def _records(path: Path):
    """Raw records of a W&B transaction log (LevelDB log format: 32 KiB blocks, 7-byte record headers)."""
    data = path.read_bytes()
    if len(data) < 7:  # not even the header yet: the service has just opened the file
        return
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # block trailer too short for a header: padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        if len(chunk) < length:  # a record still being written: the log ends before it
            break
        position += 7 + length
        if kind == 0 and length == 0:
            break
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            yield pending + chunk


def _items(items: Any) -> dict[str, Any]:
    return {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in items}


def _finished_records(path: Path, wait_s: float = 60.0) -> list[Any]:
    """The records of a finished run's transaction log, once its ``exit`` record is on disk.

    W&B's service writes the log in its own process and closes it shortly after ``run.finish()`` has
    returned, so a run finished in this process may still show only the log's header; wait for the exit
    record (it comes last) rather than read a log that is still being written.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + wait_s
    while True:
        records = []
        for raw in _records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {wait_s:.0f} s"
        time.sleep(0.05)


def read_offline_run(wandb_folder: Path) -> dict[str, Any]:
    """Decode the one offline run under ``<run_dir>/wandb``: run attributes, config, history, summary."""
    runs = read_offline_runs(wandb_folder)
    assert len(runs) == 1, f"expected one offline run in {wandb_folder}, found {[r['folder'] for r in runs]}"
    return runs[0]


def read_offline_runs(wandb_folder: Path) -> list[dict[str, Any]]:
    """Every offline run segment under ``<run_dir>/wandb`` (a resumed run adds one), in the order written."""
    return [_read_segment(path) for path in sorted(Path(wandb_folder).glob("offline-run-*/run-*.wandb"))]


def _read_segment(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"folder": path.parent, "history": [], "summary": {}, "metrics": []}
    for record in _finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(
                group=run.run_group,
                name=run.display_name,
                tags=list(run.tags),
                job_type=run.job_type,
                project=run.project,
                id=run.run_id,
                sweep_id=run.sweep_id,
                config=_items(run.config.update),
            )
        elif kind == "history":
            out["history"].append(_items(record.history.item))
        elif kind == "summary":
            out["summary"].update(_items(record.summary.update))
        elif kind == "metric":
            out["metrics"].append((record.metric.name or record.metric.glob_name, record.metric.step_metric))
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_complete_metrics(lines: list[dict[str, Any]]) -> None:
    """Every training step logged, and the final evaluation after the last step."""
    assert [line["step"] for line in lines if "reward/mean" in line] == list(range(SMOKE_STEPS))
    assert lines[-1]["step"] == SMOKE_STEPS and "eval/reward/mean" in lines[-1]


def assert_close(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, float) or isinstance(actual, float):
        assert math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12), (where, actual, expected)
    else:
        assert actual == expected, (where, actual, expected)


# ------------------------------------------------------------------------------------------ sweeps


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> Sweep:
    return smoke_sweep(tmp_path_factory.getbasetemp())


def test_smoke_sweep_gives_one_offline_wandb_run_per_job(basic_sweep: Sweep) -> None:
    jobs = basic_sweep.jobs()
    assert [swept(job) for job in jobs] == SMOKE_JOBS
    assert [job.name for job in jobs] == ["0_grpo,k3", "1_grpo,kl", "2_rloo,k3", "3_rloo,kl"]
    groups = set()
    for job in jobs:
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        run = read_offline_run(job / "wandb")
        name = swept(job)  # override string, e.g. algorithm=grpo,kl=k3
        algorithm, kl = (part.split("=")[1] for part in name.split(","))
        groups.add(run["group"])
        assert run["name"] == name
        assert run["tags"] == name.split(",")
        assert (run["project"], run["job_type"]) == ("rlhf_lab", "train")
        # The resolved config, plus the flat keys the dashboard groups by.
        for section in ("algorithm", "kl", "trainer", "model"):
            assert run["config"][section] == config[section]
        assert run["config"]["seed"] == config["seed"] == 0
        assert run["config"]["experiment_name"] == "smoke"
        assert (run["config"]["algorithm_name"], run["config"]["kl_name"]) == (algorithm, kl)
        assert run["config"]["kl_placement"] == config["kl"]["placement"]
        assert ("*", "step") in run["metrics"]  # every metric is plotted against `step`
        # The W&B files live under the run folder.
        assert run["folder"].parent == job / "wandb"

        # History: one row per step (W&B's step is the trainer's: the step-0 evaluation and training lines are one
        # row), holding that step's metrics.jsonl lines, same keys and values.
        lines = read_metrics(job)
        assert_complete_metrics(lines)
        steps: dict[int, dict[str, Any]] = {}
        for line in lines:
            steps.setdefault(line["step"], {}).update(line)
        assert [row["_step"] for row in run["history"]] == sorted(steps)
        for row in run["history"]:
            logged = {k: v for k, v in row.items() if not k.startswith(("_", "samples", "eval_samples"))}
            assert logged.keys() == steps[row["step"]].keys()
            for key, value in steps[row["step"]].items():
                assert_close(logged[key], value, f"{job.name} step {row['step']} {key}")
        # Generation samples: an incremental table at every step (samples_every=1 in the smoke experiment).
        sample_rows = [row for row in run["history"] if "samples.nrows" in row]
        assert [row["step"] for row in sample_rows] == list(range(SMOKE_STEPS))
        assert sample_rows[0]["samples.log_mode"] == "INCREMENTAL"
        # Evaluation samples: their own table, with the evaluation lines (before and after training here).
        eval_rows = [row for row in run["history"] if "eval_samples.nrows" in row]
        assert [row["step"] for row in eval_rows] == [0, SMOKE_STEPS]
        # The final summary.
        summary = json.loads((job / "summary.json").read_text())
        for key, value in summary.items():
            assert_close(run["summary"][key], value, f"{job.name} summary {key}")
        assert f"wandb sync {run['folder']}" in basic_sweep.output
    assert groups == {f"smoke-{basic_sweep.folder.name}"}


def _interval(job: Path) -> tuple[float, float]:
    """A job's start (Hydra writes .hydra/ before the task runs) and end (summary.json is its last file)."""
    return (job / ".hydra" / "config.yaml").stat().st_mtime, (job / "summary.json").stat().st_mtime


def test_joblib_launcher_runs_two_jobs_in_parallel(tmp_path_factory, basic_sweep: Sweep) -> None:
    sweep = smoke_sweep(tmp_path_factory.getbasetemp(), "joblib")
    print(f"smoke sweep wall time: basic {basic_sweep.wall_s:.1f} s, joblib (2 jobs) {sweep.wall_s:.1f} s")
    assert "Joblib.Parallel(n_jobs=2" in sweep.output
    jobs = sweep.jobs()
    assert [swept(job) for job in jobs] == SMOKE_JOBS
    for job in jobs:  # every folder complete
        for name in (".hydra/config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json"):
            assert (job / name).is_file(), f"{job}/{name} missing"
        assert_complete_metrics(read_metrics(job))
        state = json.loads((job / "checkpoints" / f"step_{SMOKE_STEPS}" / "trainer_state.json").read_text())
        assert state["optimizer_saved"] is False  # a sweep's job saves its model only (trainer.save=auto)
        run = read_offline_run(job / "wandb")
        assert run["group"] == f"smoke-{sweep.folder.name}"
        assert run["name"] == swept(job)
    (start0, end0), (start1, end1) = _interval(jobs[0]), _interval(jobs[1])
    assert max(start0, start1) < min(end0, end1), "jobs 0 and 1 did not run at the same time"


# ------------------------------------------------------------------------------------------ configs


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_lab.config import CONF_DIR, register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def test_slurm_launcher_config_composes() -> None:
    launcher = _compose("hydra/launcher=slurm").hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.partition is None  # the cluster's default unless hydra.launcher.partition=NAME
    assert (launcher.timeout_min, launcher.cpus_per_task, launcher.gpus_per_node, launcher.mem_gb) == (240, 8, 1, 32)
    assert (launcher.nodes, launcher.tasks_per_node) == (1, 1)
    assert launcher.submitit_folder.endswith("/.submitit/%j")
    launcher = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "experiment=smoke").hydra.launcher
    assert launcher.partition == "gpu"


def test_slurm_launcher_submits_one_array_with_these_sbatch_options(tmp_path: Path, monkeypatch) -> None:
    """``hydra/launcher=slurm experiment=smoke``: the parameters hydra-submitit-launcher gives submitit and the sbatch
    script submitit writes from them, captured where ``sbatch`` would run (no cluster here: srun is faked present)."""
    import submitit
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.utils import instantiate
    from submitit.core.utils import DelayedSubmission
    from submitit.slurm.slurm import SlurmExecutor

    sweep_dir = tmp_path / "sweep"
    cfg = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "experiment=smoke", f"hydra.sweep.dir={sweep_dir}")
    assert _compose("hydra/launcher=submitit_slurm").hydra.launcher._target_ == cfg.hydra.launcher._target_

    class Submitted(Exception):
        pass

    updates: dict[str, Any] = {}
    executors: list[Any] = []
    scripts: list[str] = []
    real_update = submitit.AutoExecutor.update_parameters

    def update_parameters(self, **kwargs: Any) -> None:
        updates.update(kwargs)
        executors.append(self)
        real_update(self, **kwargs)  # submitit's own check of every name and value

    def submit_command(self, command: str):
        scripts.append(self._make_submission_file_text(command, "uid"))
        raise Submitted  # instead of running sbatch

    monkeypatch.setattr(submitit.AutoExecutor, "update_parameters", update_parameters)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    monkeypatch.setattr(SlurmExecutor, "_submit_command", submit_command)

    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=lambda job_cfg: None, config=cfg)
    params = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()])
    (jobs,) = BasicSweeper.split_arguments(params, max_batch_size=None)  # the smoke sweep's 4 jobs, as Hydra splits it
    with pytest.raises(Submitted):
        launcher.launch(jobs, initial_job_idx=0)

    assert updates == {
        "timeout_min": 240, "cpus_per_task": 8, "gpus_per_node": 1, "tasks_per_node": 1, "mem_gb": 32, "nodes": 1,
        "name": "rlhf_lab-smoke", "stderr_to_stdout": False, "slurm_partition": "gpu", "slurm_qos": None,
        "slurm_comment": None, "slurm_constraint": None, "slurm_exclude": None, "slurm_gres": None,
        "slurm_cpus_per_gpu": None, "slurm_gpus_per_task": None, "slurm_mem_per_gpu": None, "slurm_mem_per_cpu": None,
        "slurm_account": None, "slurm_signal_delay_s": 120, "slurm_additional_parameters": {},
        "slurm_array_parallelism": 32, "slurm_setup": None,
    }
    (executor,) = executors
    assert executor.cluster == "slurm" and executor._executor.max_num_timeout == 0
    assert executor.folder == sweep_dir / ".submitit" / "%j"
    (script,) = scripts  # one sbatch call: the whole sweep as one job array
    logs = sweep_dir / ".submitit" / "%A_%a"
    for line in ("--array=0-3%4", "--partition=gpu", "--time=240", "--cpus-per-task=8", "--gpus-per-node=1",
                 "--mem=32GB", "--nodes=1", "--ntasks-per-node=1", "--job-name=rlhf_lab-smoke",
                 f"--output={logs}/%A_%a_0_log.out", "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in script, (line, script)
    assert f"-u -m submitit.core._submit {sweep_dir}/.submitit/%j" in script.splitlines()[-1]
    # Each array task's pickled call (written by this test): the job's overrides and number in the sweep folder.
    calls = [DelayedSubmission.load(path) for path in (sweep_dir / ".submitit").glob("*.pkl")]
    assert [",".join(job) for job in jobs] == SMOKE_JOBS
    assert sorted((call.args[2], list(call.args[0]), call.args[1]) for call in calls) == [
        (number, list(job), "hydra.sweep.dir") for number, job in enumerate(jobs)
    ]
    assert all(type(call.function).__name__ == "SlurmLauncher" for call in calls)


def test_joblib_local_launcher_config_composes() -> None:
    launcher = _compose("hydra/launcher=joblib_local").hydra.launcher
    assert launcher._target_.endswith("JoblibLauncher")
    assert launcher.n_jobs == 2


EXPERIMENT_SWEEPS = {
    "smoke": {"algorithm": "grpo,rloo", "kl": "k3,kl"},
    "kl_ablation": {"kl": "kl,abs,mse,k3,full,none", "kl.placement": "reward,loss", "seed": "0,1,2"},
    "algo_comparison": {"algorithm": "ppo,grpo,dr_grpo,dapo,rloo,reinforce,reinforce_pp,remax,gspo,cispo",
                        "seed": "0,1,2"},
    "algo_comparison_exact": {"algorithm": "ppo,grpo,dapo,rloo,reinforce,reinforce_pp,remax,gspo,cispo",
                              "seed": "0,1,2"},
}


@pytest.mark.parametrize("name", sorted(EXPERIMENT_SWEEPS))
def test_experiment_selects_a_whole_sweep(name: str) -> None:
    from rlhf_lab.config.compose import compose as compose_and_validate
    from rlhf_lab.config.compose import group_options

    assert (REPO / "conf" / "experiment" / f"{name}.yaml").is_file()
    cfg = _compose(f"experiment={name}")
    assert cfg.experiment_name == name
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = dict(cfg.hydra.sweeper.params)
    assert params == EXPERIMENT_SWEEPS[name]
    for group in ("algorithm", "kl"):
        for option in params.get(group, "").split(","):
            assert not option or option in group_options(group), f"{name}: {group}={option} has no config"
    compose_and_validate([f"+experiment={name}"])  # what the CLI checks before Hydra runs
    # Every job of the sweep composes and validates (compose_and_validate takes a sweep's first value).
    first_values = {key: values.split(",")[0] for key, values in params.items()}
    for key, values in params.items():
        for value in values.split(","):
            job = {**first_values, key: value}
            compose_and_validate([f"+experiment={name}", *(f"{k}={v}" for k, v in job.items())])


def test_experiment_sizes() -> None:
    sizes = {name: math.prod(len(v.split(",")) for v in params.values()) for name, params in EXPERIMENT_SWEEPS.items()}
    assert sizes == {"smoke": 4, "kl_ablation": 36, "algo_comparison": 30, "algo_comparison_exact": 27}
    assert _compose("experiment=smoke").model.name == "tiny"
    kl = _compose("experiment=algo_comparison").kl
    assert (kl.name, kl.placement) == ("kl", "reward")


def test_unknown_experiment_is_a_one_line_error() -> None:
    from rlhf_lab.config.compose import check_overrides
    from rlhf_lab.errors import UserError

    with pytest.raises(UserError, match="experiment='nope' is not an option; choose from: .*kl_ablation"):
        check_overrides(["+experiment=nope"])
