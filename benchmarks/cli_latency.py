"""How long a user waits for the first output of the commands they type most: ``rlhf-lab --help``, a typo's
did-you-mean, a compose error, and a run until its first line.

Each command runs ``--repeats`` times in a fresh process (``python -m rlhf_lab ...``, so the interpreter's start
counts, as it does for a user); the median seconds until the process's first byte of output, and until it exits,
are printed as a table and one line of JSON. ``--root DIR`` measures another checkout (a worktree of an older
commit: the before of a before/after). Not a timed test: the figures depend on the machine and its load.

    python -m benchmarks.cli_latency --repeats 5
    git worktree add /tmp/before HEAD~3 && python -m benchmarks.cli_latency --root /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "--help": ["--help"],
    "typo (did you mean)": ["algoritm=grpo"],
    "compose error": ["model=tiny", "trainer.lr=-1"],
    "run, first line": ["model=tiny", "trainer.steps=1", "trainer.prompts_per_step=2", "algorithm.group_size=2",
                        "trainer.max_new_tokens=4", "trainer.eval_prompts=0", "trainer.save=none"],
}


def first_output(command: list[str], cwd: Path, env: dict[str, str], limit: float) -> tuple[float, float]:
    """(seconds until the first byte on stdout or stderr, seconds until the process exits); a run is stopped at
    its first line, as a user sees what it does then."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = None
    streams = [process.stdout, process.stderr]
    while first is None and time.perf_counter() - start < limit:
        ready, _, _ = select.select(streams, [], [], 0.05)
        if any(stream.read1(1) if hasattr(stream, "read1") else stream.read(1) for stream in ready):
            first = time.perf_counter() - start
        elif process.poll() is not None and not ready:
            break
    if "trainer.steps=1" in command:
        process.kill()
    process.communicate(timeout=limit)
    return (first if first is not None else float("nan")), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cli_latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose rlhf_lab is timed (default: this one)")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds one command may take")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "RLHF_LAB_TRACEBACK": "0"}
    results = {}
    for name, arguments in COMMANDS.items():
        runs = [first_output([sys.executable, "-m", "rlhf_lab", *arguments], root, env, args.limit)
                for _ in range(args.repeats)]
        results[name] = {"first_output_s": statistics.median(r[0] for r in runs),
                         "exit_s": statistics.median(r[1] for r in runs)}
    print(f"{'command':<24}{'first output s':>16}{'exit s':>10}   ({args.repeats} runs each, median; {root})")
    for name, figures in results.items():
        print(f"{name:<24}{figures['first_output_s']:>16.2f}{figures['exit_s']:>10.2f}")
    print(json.dumps({"root": str(root), "repeats": args.repeats, "commands": results}))


if __name__ == "__main__":
    main()
