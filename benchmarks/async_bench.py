"""Synchronous against asynchronous training, the engine in a process of its own (``rlhf-lab serve --engine hf``).

    python -m benchmarks.async_bench --model smollm2_135m --steps 8            # the embedded model
    python -m benchmarks.async_bench --model tiny --steps 12 --json out.json   # the tiny random Llama

One server, started once, serves every arm; each arm is one ``rlhf-lab`` run against it (``generation=vllm_server``):

- ``sync``: ``generation.max_staleness=0``: the trainer waits for each batch, the server waits for each update;
- ``async k=1`` / ``async k=2``: the server samples the next k batches while the trainer trains, and takes each new
  version of the weights between two of its decode steps (``generation.weight_updates=in_flight``);
- ``partial k=1``: the same, the requests resumed with their cache recomputed at each landing;
- ``groups S=2B``: the server's stream of groups (``generation.continuous=true``): twice a step's groups launched and
  not yet trained on, each step taking those that completed first, each version landing between two ticks.

The core split: the server and the trainer each run torch on one thread and, where the machine has two cores or
more, each is pinned to a core of its own (``os.sched_setaffinity``): the figures are what two processes on two
cores give. Per arm: the median seconds per step and sampled tokens per second (the first step, a warm-up, left
out), and what the speed cost in staleness (the mean staleness of a token, the share of samples spanning versions).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ARMS = {
    "sync": ["generation.max_staleness=0"],
    "async k=1": ["generation.max_staleness=1", "generation.weight_updates=in_flight"],
    "async k=2": ["generation.max_staleness=2", "generation.weight_updates=in_flight"],
    "partial k=1": ["generation.max_staleness=1", "generation.weight_updates=partial"],
    "groups S=2B": ["generation.continuous=true", "generation.weight_updates=in_flight"],
}
SETTINGS = {"tiny": ["trainer.prompts_per_step=4", "algorithm.group_size=4", "trainer.max_new_tokens=32"],
            "smollm2_135m": ["trainer.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_new_tokens=48"]}


def model_folder(name: str, work: Path) -> Path:
    """The model's weights and tokenizer in a folder the server loads (the run's own initial weights)."""
    if name == "smollm2_135m":
        from rlhf_lab.models.loading import smollm2_model_path

        return smollm2_model_path()
    from rlhf_lab.config import compose
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny"])
    tokenizer = loading.load_tokenizer(cfg.model)
    folder = work / "model"
    loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pinned(core: int | None):
    """A child's start: on ``core`` alone (None: wherever the OS puts it)."""
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def start_server(folder: Path, sync: Path, core: int | None) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "rlhf_lab", "serve", str(folder), "--engine", "hf", "--port",
                               str(port), "--sync-folder", str(sync), "--max-model-len", "512"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=pinned(core))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"rlhf-lab serve stopped: {server.stderr.read()[-2000:]}")
        try:
            token = (sync / ".serve_token").read_text().strip()
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={
                "Authorization": f"Bearer {token}"}), timeout=5).read()
            return server, port
        except OSError:
            time.sleep(0.5)
    raise SystemExit("rlhf-lab serve did not answer within 300 s")


def run_arm(name: str, model: str, steps: int, port: int, sync: Path, work: Path, core: int | None) -> dict[str, Any]:
    run = work / name.replace(" ", "_").replace("=", "")
    command = [sys.executable, "-m", "rlhf_lab", f"model={model}", *SETTINGS[model], *ARMS[name],
               f"trainer.steps={steps}", "trainer.eval_prompts=0", "trainer.progress_bar=false", "logger=none",
               "trainer.save=none", "trainer.num_threads=1", "trainer.precision=fp32", "generation=vllm_server",
               f"generation.url=http://127.0.0.1:{port}", f"generation.sync_folder={sync}", f"trainer.output_dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=pinned(core))
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{name} failed: {result.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "time/step_s" in row][1:]  # the first step: a warm-up
    steps_s = [row["time/step_s"] for row in rows]

    def mean(key: str) -> float:
        values = [row[key] for row in rows if key in row]
        return statistics.fmean(values) if values else float("nan")

    return {"arm": name, "overrides": ARMS[name], "wall_s": wall, "step_s_median": statistics.median(steps_s),
            "tokens_per_s_median": statistics.median(row["throughput/tokens_per_s"] for row in rows),
            "staleness_token_mean": mean("staleness/token_mean"),
            "multi_version_frac": mean("staleness/multi_version_frac")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SETTINGS), default="smollm2_135m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"the arms to run, comma-separated (the first is the "
                                                               f"speed-up's base; default: {','.join(ARMS)})")
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        parser.error(f"--arms: {unknown[0]!r} is not an arm; choose from: {', '.join(ARMS)}")
    cores = sorted(os.sched_getaffinity(0))
    server_core, trainer_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    with tempfile.TemporaryDirectory(prefix="rlhf_lab_async_bench_") as tmp:
        work = Path(tmp)
        sync = work / "sync"
        sync.mkdir()
        folder = model_folder(args.model, work)
        server, port = start_server(folder, sync, server_core)
        try:
            results = [run_arm(name, args.model, args.steps, port, sync, work, trainer_core) for name in arms]
        finally:
            server.terminate()
            server.wait(60)
    split = (f"server on core {server_core}, trainer on core {trainer_core}" if server_core is not None
             else "one core shared")
    print(f"model={args.model}, {args.steps} steps ({' '.join(SETTINGS[args.model])}); {split}; one torch thread each")
    print("| arm | s/step (median) | tokens/s (median) | speed-up | staleness/token_mean | multi_version_frac |")
    print("|---|---|---|---|---|---|")
    base = results[0]["step_s_median"]
    for result in results:
        print(f"| {result['arm']} | {result['step_s_median']:.3f} | {result['tokens_per_s_median']:.0f} | "
              f"{base / result['step_s_median']:.2f}x | {result['staleness_token_mean']:.2f} | "
              f"{result['multi_version_frac']:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"schema": "rlhf_lab.async_bench/1", "model": args.model, "steps": args.steps,
                                         "core_split": split, "arms": results}, indent=2))


if __name__ == "__main__":
    main()
