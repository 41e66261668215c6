"""Scale-out figures: processes, precision and memory savers, each run as a real ``rlhf-lab`` process.

    python -m benchmarks.scale_bench --processes --steps 4            # 1 vs 2 processes (tiny, SmolLM2)
    python -m benchmarks.scale_bench --memory --steps 3               # SmolLM2 GRPO peak RSS per setting
    python -m benchmarks.scale_bench --learning --seeds 0,1,2         # the default run (make train), per seed
    python -m benchmarks.scale_bench --env --steps 6                  # 2-turn episodes vs one turn (tiny, SmolLM2)
    python -m benchmarks.scale_bench --calculator 300                 # SmolLM2 on env=calculator for 300 s

Each job runs in a fresh process tree (``torchrun`` for 2 processes); its median seconds per step come from
its ``metrics.jsonl`` (the first step, a warm-up, left out), its peak RSS from the operating system (the
largest process of the tree). ``--json PATH`` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WRAPPER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")
QUIET = ["logger=none", "trainer.progress_bar=false", "trainer.eval_prompts=0"]
TINY = ["model=tiny", "trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.max_new_tokens=16"]
SMOLLM2 = ["model=smollm2_135m", "trainer.prompts_per_step=2", "algorithm.group_size=8", "trainer.max_new_tokens=32"]
MEMORY_SETTINGS = {
    "fp32": [],
    "bf16-mixed": ["trainer.precision=bf16-mixed"],
    "gradient_checkpointing": ["trainer.gradient_checkpointing=true"],
    "offload_reference": ["trainer.offload_reference=true"],
    "logprob_chunk=4": ["trainer.logprob_chunk=4"],
}


def run_job(overrides: list[str], processes: int, work: Path) -> dict[str, Any]:
    """One training run; its median s/step (after the first step), peak RSS (MiB) and summary."""
    launcher = [sys.executable, "-m", "rlhf_lab"]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                    "-m", "rlhf_lab"]
    run_dir = work / f"run_{len(list(work.iterdir()))}"
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", WRAPPER, *launcher, *overrides, f"trainer.output_dir={run_dir}"],
                            capture_output=True, text=True, env=env)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(overrides)}): {result.stderr.strip().splitlines()[-1:]}")
    peak_kib = int(result.stderr.strip().splitlines()[-1])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line["time/step_s"] for line in lines if "time/step_s" in line]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"overrides": overrides, "processes": processes, "step_s_median": statistics.median(steps[1:] or steps),
            "peak_rss_mib": peak_kib / 1024, "summary": summary, "wall_s": wall_s,
            "steps_done": len(steps), "last": next((line for line in reversed(lines) if "time/step_s" in line), {})}


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def processes_section(steps: int, work: Path) -> tuple[str, list[dict[str, Any]]]:
    results, rows = [], []
    for name, model in (("tiny", TINY), ("smollm2_135m", SMOLLM2)):
        one = run_job([*model, *QUIET, f"trainer.steps={steps}"], 1, work)
        two = run_job([*model, *QUIET, f"trainer.steps={steps}"], 2, work)
        results += [one, two]
        rows.append([name, f"{one['step_s_median']:.2f}", f"{two['step_s_median']:.2f}",
                     f"{two['step_s_median'] / one['step_s_median']:.2f}",
                     f"{one['peak_rss_mib']:.0f} / {two['peak_rss_mib']:.0f}"])
    return table(["model", "1 process s/step", "2 processes s/step", "ratio", "peak RSS MiB (1 / 2)"], rows), results


def memory_section(steps: int, work: Path) -> tuple[str, list[dict[str, Any]]]:
    results, rows = [], []
    for name, overrides in MEMORY_SETTINGS.items():
        result = run_job([*SMOLLM2, *QUIET, f"trainer.steps={steps}", *overrides], 1, work)
        results.append(result)
        rows.append([name, f"{result['peak_rss_mib']:.0f}", f"{result['step_s_median']:.2f}"])
    return table(["setting (SmolLM2 GRPO, 16 x 32)", "peak RSS MiB", "s/step"], rows), results


# 16 trajectories a step (4 prompts x 4), up to two model turns of at most 16 tokens (the guessing game), GRPO. A
# turn cut at the token limit ends its episode, so turns end at stop strings: a sentence's end for SmolLM2, any of
# a few letters for the random tiny model (which writes no EOS).
EPISODES = ["env=guess_number", "env.max_turns=2", "env.max_tokens=96"]
TURN_ENDS = {"tiny": "env.stop=[a,e,i,o,u,n,t,s]", "smollm2_135m": "env.stop=['.','!','?','\\n']"}


def env_section(steps: int, work: Path) -> tuple[str, list[dict[str, Any]]]:
    """Seconds per step of 2-turn episodes against one-turn responses on the same settings, per model."""
    results, rows = [], []
    for name in ("tiny", "smollm2_135m"):
        common = [f"model={name}", *QUIET, f"trainer.steps={steps}", "trainer.prompts_per_step=4",
                  "algorithm.group_size=4", "trainer.max_new_tokens=16"]
        single = run_job(common, 1, work)
        episodes = run_job([*common, *EPISODES, TURN_ENDS[name]], 1, work)
        results += [single, episodes]
        rows.append([name, f"{single['step_s_median']:.2f}", f"{episodes['step_s_median']:.2f}",
                     f"{1 / episodes['step_s_median']:.2f}", f"{episodes['step_s_median'] / single['step_s_median']:.2f}",
                     f"{episodes['last'].get('env/turns_mean', float('nan')):.2f}",
                     f"{episodes['last'].get('response/length_mean', float('nan')):.1f}"])
    headers = ["model", "one turn s/step", "2-turn episodes s/step", "episode steps/s", "ratio", "turns (last step)",
               "model tokens per episode"]
    return table(headers, rows), results


def calculator_section(seconds: int, work: Path) -> tuple[str, list[dict[str, Any]]]:
    """The embedded model on the calculator task for a wall-clock budget: reward first 20% -> last 20% of steps."""
    overrides = ["env=calculator", *QUIET, "trainer.steps=1000", f"trainer.max_train_seconds={seconds}",
                 "trainer.max_new_tokens=64", "trainer.prompts_per_step=4", "algorithm.group_size=4",
                 "env.operands=2", "env.max_operand=20", "env.operators=+", "trainer.lr=1e-5"]
    result = run_job(overrides, 1, work)
    summary = result["summary"]
    row = [f"{summary.get('reward/first_20pct_mean', float('nan')):.3f}",
           f"{summary.get('reward/last_20pct_mean', float('nan')):.3f}", str(result["steps_done"]),
           f"{result['step_s_median']:.1f}", f"{result['last'].get('env/tool_calls', float('nan')):.2f}"]
    return table(["reward first 20%", "last 20%", "steps", "s/step", "tool calls (last step)"], [row]), [result]


def learning_section(seeds: list[int], work: Path) -> tuple[str, list[dict[str, Any]]]:
    results, rows = [], []
    for seed in seeds:
        result = run_job(["trainer.progress_bar=false", f"seed={seed}"], 1, work)  # make train's settings
        results.append(result)
        summary = result["summary"]
        first, last = summary["reward/first_20pct_mean"], summary["reward/last_20pct_mean"]
        rows.append([str(seed), f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}",
                     f"{summary.get('before/eval/reward/mean', float('nan')):.3f} -> "
                     f"{summary.get('eval/reward/mean', float('nan')):.3f}", f"{result['step_s_median']:.1f}",
                     f"{summary['time/total_s'] / 60:.1f}", f"{result['wall_s'] / 60:.1f}", summary.get("precision", "")])
    headers = ["seed", "reward first 20%", "last 20%", "gain", "eval before -> after", "s/step", "training min",
               "whole run min", "precision"]
    return table(headers, rows), results


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--processes", action="store_true", help="1 vs 2 processes on tiny and SmolLM2")
    parser.add_argument("--memory", action="store_true", help="SmolLM2 peak RSS per precision / memory saver")
    parser.add_argument("--learning", action="store_true", help="the default run (make train), per seed")
    parser.add_argument("--env", action="store_true", help="2-turn episodes vs one turn on tiny and SmolLM2")
    parser.add_argument("--calculator", type=int, default=0, help="seconds of SmolLM2 on env=calculator")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args(args)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlhf_lab_scale_") as tmp:
        work = Path(tmp)
        sections = [("processes", options.processes, lambda: processes_section(options.steps, work)),
                    ("memory", options.memory, lambda: memory_section(options.steps, work)),
                    ("learning", options.learning,
                     lambda: learning_section([int(s) for s in options.seeds.split(",")], work)),
                    ("env", options.env, lambda: env_section(options.steps, work)),
                    ("calculator", options.calculator > 0, lambda: calculator_section(options.calculator, work))]
        for name, wanted, run in sections:
            if wanted:
                text, results = run()
                report[name] = results
                print(f"\n## {name}\n{text}", flush=True)
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
