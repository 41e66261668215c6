"""One run on two processes (torchrun, gloo on CPU) equals the same run in one process.

Every run here is a real ``python -m rlhf_lab`` (or ``torchrun ... -m rlhf_lab``) process on the tiny model with
``trainer.seed_per_prompt=true``, so each prompt group samples the same tokens however prompts are sharded.
With the same global batch and seed, a 2-process DDP or FSDP2 run logs the same metrics and ends with the same
weights as the 1-process run, to float tolerance (batches of other shapes sum in another order).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.limits import HANG_GUARD_S

TINY = [
    "model=tiny", "trainer.precision=fp32", "trainer.steps=3", "trainer.prompts_per_step=2", "algorithm.group_size=2",
    "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.progress_bar=false", "trainer.num_threads=1",
    "trainer.lr=1e-3", "trainer.seed_per_prompt=true", "reward=length",
]
ALGORITHMS = {
    "grpo": ["algorithm=grpo", "kl=k3", "kl.placement=loss"],
    "ppo": ["algorithm=ppo", "algorithm.mini_batch_size=4", "kl=kl", "kl.placement=reward"],
    # GRPO's KL factor: a group of equal rewards takes the mean factor of every rank's other groups
    "grpo_kl_scaled": ["algorithm=grpo", "kl=k3", "kl.placement=loss", "kl.loss_scale=advantage"],
}
WALL_CLOCK = ("time/", "throughput/", "perf/")
TIMEOUT = HANG_GUARD_S


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # this checkout's package
    return env


def command(processes: int, *overrides: str) -> list[str]:
    launcher = [sys.executable, "-m", "rlhf_lab"]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                    "-m", "rlhf_lab"]
    replaced = {o.split("=", 1)[0] for o in overrides}  # the command line refuses a key given twice
    return [*launcher, *(o for o in TINY if o.split("=", 1)[0] not in replaced), *overrides]


def train(run_dir: Path, processes: int, *overrides: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command(processes, *overrides, f"trainer.output_dir={run_dir}"), cwd=run_dir.parent,
                            capture_output=True, text=True, timeout=TIMEOUT, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(WALL_CLOCK)} for line in lines]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model" / "model.safetensors"))


def assert_same_run(one: Path, two: Path, rel: float = 1e-4, atol: float = 1e-5) -> None:
    expected, got = metrics(one), metrics(two)
    assert [line["step"] for line in got] == [line["step"] for line in expected]
    for want, have in zip(expected, got):
        assert have.keys() == want.keys()
        for key, value in want.items():
            assert have[key] == pytest.approx(value, rel=rel, abs=1e-5), (want["step"], key)
    final = max(int(p.name.split("_")[1]) for p in (one / "checkpoints").glob("step_*"))
    reference, candidate = weights(one, final), weights(two, final)
    assert reference.keys() == candidate.keys()
    for name in reference:
        torch.testing.assert_close(candidate[name], reference[name], rtol=0, atol=atol)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    """The 1-process reference run of each algorithm (shared by the tests below)."""
    root = tmp_path_factory.mktemp("one_process")
    runs = {}
    for name, overrides in ALGORITHMS.items():
        runs[name] = root / name
        train(runs[name], 1, *overrides)
    return runs


@pytest.mark.parametrize(("algorithm", "strategy"), [("grpo", "ddp"), ("ppo", "ddp"), ("grpo", "fsdp"),
                                                   ("grpo_kl_scaled", "ddp")])
def test_two_processes_equal_one(one_process, tmp_path: Path, algorithm: str, strategy: str) -> None:
    two = tmp_path / "two"
    train(two, 2, *ALGORITHMS[algorithm], f"trainer.strategy={strategy}")
    assert_same_run(one_process[algorithm], two)
    # Rank 0 alone writes: one metrics line per step, one checkpoint folder, no second writer's files.
    steps = [line["step"] for line in metrics(two) if "reward/mean" in line]
    assert steps == [0, 1, 2]
    assert sorted(p.name for p in (two / "checkpoints").glob("step_*")) == ["step_3"]


def test_two_fsdp_ranks_at_cuda_s_compute_defaults_equal_one_plain_process(one_process, tmp_path: Path) -> None:
    """The LM head in chunks under FSDP2 (the gathered weight in the training pass, a copy of it kept by the decode
    and the reference pass for the exact KL), with gradient checkpointing and a token budget, as a GPU runs by
    default: the same run as one process with whole logits. (The weights to 1e-4: AdamW makes the tiny gradients
    of never-sampled tokens' embedding rows lr-sized steps, so float rounding in another order moves a few of them
    by ~5e-5 in three steps, with the whole logits on these ranks as well.)"""
    two = tmp_path / "two"
    train(two, 2, *ALGORITHMS["grpo"], "trainer.strategy=fsdp", "trainer.chunked_logprobs=true",
          "trainer.lm_head_chunk=3", "trainer.gradient_checkpointing=true", "trainer.max_tokens_per_micro_batch=512")
    assert_same_run(one_process["grpo"], two, atol=1e-4)


def test_fsdp_in_one_process_equals_the_plain_run(one_process, tmp_path: Path) -> None:
    run = tmp_path / "fsdp"
    train(run, 1, *ALGORITHMS["grpo"], "trainer.strategy=fsdp")
    assert_same_run(one_process["grpo"], run)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The 1-process run straight to step 4, a checkpoint every step (shared by the tests below)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, 1, *ALGORITHMS["grpo"], "trainer.steps=4", "trainer.checkpoint_every=1", "trainer.keep_last_n=5")
    return run


@pytest.mark.parametrize(("first", "first_strategy", "then", "then_strategy"), [
    (2, "ddp", 1, "auto"), (1, "auto", 2, "fsdp"), (2, "fsdp", 1, "auto"), (2, "fsdp", 2, "fsdp")])
def test_checkpoints_load_across_process_counts(straight: Path, tmp_path: Path, first: int, first_strategy: str,
                                                then: int, then_strategy: str) -> None:
    """A checkpoint continues under another process count or strategy, and the continuation equals the 1-process
    run straight to step 4. An FSDP run's checkpoint holds its sharded state (``sharded/``, written by every rank
    through torch.distributed.checkpoint, each rank reading back its own part), and only its last the whole weights."""
    run = tmp_path / "run"
    train(run, first, *ALGORITHMS["grpo"], "trainer.steps=4", "trainer.checkpoint_every=1",
          "trainer.keep_last_n=5", f"trainer.strategy={first_strategy}")
    assert (run / "checkpoints" / "step_2" / "sharded").is_dir() == (first_strategy == "fsdp")
    # Under FSDP only the run's last save gathers the whole weights (model/); the others are shards only.
    assert (run / "checkpoints" / "step_2" / "model").is_dir() == (first_strategy != "fsdp")
    assert (run / "checkpoints" / "step_4" / "model").is_dir()
    # Back to the checkpoint after 2 updates, as if the run had died there, and continue with the other process count.
    for late in ("step_3", "step_4"):
        subprocess.run(["rm", "-rf", str(run / "checkpoints" / late)], check=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    continued = train(run, then, *ALGORITHMS["grpo"], "trainer.steps=4", "trainer.checkpoint_every=1",
                      "trainer.keep_last_n=5", "trainer.resume=auto", f"trainer.strategy={then_strategy}")
    assert "resumed from" in continued.stdout + continued.stderr
    assert_same_run(straight, run)


def test_fsdp_ranks_with_uneven_evaluation_shards_stay_in_step(tmp_path: Path) -> None:
    """Three held-out prompts over two FSDP ranks: rank 0 has two, rank 1 one. Every FSDP forward pass is a
    collective, so rank 1 generates a padding prompt too (dropped); the evaluation equals the 1-process one."""
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, 1, *ALGORITHMS["grpo"], "trainer.eval_prompts=3", "trainer.steps=1")
    train(two, 2, *ALGORITHMS["grpo"], "trainer.eval_prompts=3", "trainer.steps=1", "trainer.strategy=fsdp")
    evaluations = [[line for line in metrics(run) if "eval/reward/mean" in line] for run in (one, two)]
    assert len(evaluations[0]) == len(evaluations[1]) == 2  # before and after training
    for want, have in zip(*evaluations):
        for key, value in want.items():
            assert have[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_multi_turn_episodes_on_two_fsdp_ranks_equal_one_process(tmp_path: Path) -> None:
    """Episodes of the guessing game end after different numbers of turns on each rank; a rank whose episodes are
    over keeps sampling along (FSDP's forward passes are collectives), and the run equals the 1-process one."""
    one, two = tmp_path / "one", tmp_path / "two"
    game = [*ALGORITHMS["grpo"], "env=guess_number", "trainer.max_new_tokens=6", "env.max_tokens=48",
            "env.stop=[a,e,i,o,u,n,t,s]", "trainer.steps=2", "trainer.eval_prompts=0", "trainer.checkpoint_every=2"]
    train(one, 1, *game)
    train(two, 2, *game, "trainer.strategy=fsdp")
    turns = [line["env/turns_mean"] for line in metrics(one)]
    assert all(1.0 < value < 4.0 for value in turns)  # episodes of several lengths
    assert_same_run(one, two)


LOCKSTEP = """
import os, sys, torch, torch.distributed as dist
from rlhf_lab.generation.hf import generate
from rlhf_lab.models import loading
from rlhf_lab.runtime import distributed
from types import SimpleNamespace
dist.init_process_group("gloo")
rank = dist.get_rank()
tokenizer = loading.load_tokenizer(SimpleNamespace(name="tiny", name_or_path=None))
dims = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)
model = distributed.shard(loading.build_tiny_llama(tokenizer, dims, seed=0))
eos = tokenizer.eos_token_id
def sample(probs):  # rank 0's rows end at their second token; rank 1's never do
    step = sample.calls = getattr(sample, "calls", 0) + 1
    token = eos if rank == 0 and step == 2 else 100
    return torch.full((probs.shape[0],), token, dtype=torch.long)
rollout = generate(model, tokenizer, ["Hi there", "Tell me more"], 2, 6, 1.0, 1.0, 0, 64, keep_logits=False,
                   sample=sample)
with open(os.path.join(os.path.dirname(sys.argv[0]), f"result_{rank}.txt"), "w") as out:
    out.write(f"{rank} {sample.calls} {rollout.response_mask.sum(-1).tolist()}")
dist.destroy_process_group()
"""


def test_fsdp_ranks_decode_in_lock_step_until_every_rank_is_done(tmp_path: Path) -> None:
    """Rank 0's responses end after two tokens, rank 1's run to the limit: under FSDP the decode gathers the weights
    once per generation (not per token), so no decode step is a collective and rank 0 stops when its own rows are
    done without leaving rank 1 waiting; each rank's responses end where they ended."""
    script = tmp_path / "lockstep.py"
    script.write_text(LOCKSTEP)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script)], capture_output=True, text=True, timeout=HANG_GUARD_S, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"result_{rank}.txt").read_text() for rank in (0, 1)]
    assert lines == ["0 2 [2.0, 2.0, 2.0, 2.0]", "1 6 [6.0, 6.0, 6.0, 6.0]"]


def test_exact_resume_after_sigkill_of_every_rank(tmp_path: Path) -> None:
    """2-process DDP with the global generator (no per-prompt seeds): killed at a random step, resumed, the
    metrics equal an uninterrupted 2-process run value for value (every rank's generator is restored)."""
    overrides = [*ALGORITHMS["grpo"], "trainer.seed_per_prompt=false", "trainer.steps=5", "trainer.checkpoint_every=1",
                 "trainer.keep_last_n=10", "trainer.eval_every=2"]
    reference = tmp_path / "reference"
    train(reference, 2, *overrides)
    run = tmp_path / "killed"
    run.mkdir()
    kill_after = random.Random(7).choice([1, 2, 3])
    process = subprocess.Popen(command(2, *overrides, f"trainer.output_dir={run}"), cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment(),
                               start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    while not (run / "checkpoints" / f"step_{kill_after}").is_dir() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # torchrun and both ranks at once
    process.wait(timeout=HANG_GUARD_S)
    train(run, 2, *overrides, "trainer.resume=auto")
    assert metrics(run) == metrics(reference)


def test_a_failing_rank_stops_every_rank_with_its_message(tmp_path: Path) -> None:
    module = tmp_path / "rank_reward.py"
    module.write_text(
        "import os\n"
        "def score(prompts, responses):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise RuntimeError('rank one cannot score')\n"
        "    return [0.0] * len(responses)\n"
    )
    env = {**environment(), "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(command(2, "reward=python", "reward.function=rank_reward:score",
                                    f"trainer.output_dir={tmp_path / 'run'}"),  # a rank left waiting: past the guard
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "rank one cannot score" in errors[0], result.stderr[-3000:]


def test_a_batch_that_does_not_split_into_whole_groups_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(command(2, "trainer.prompts_per_step=3", f"trainer.output_dir={tmp_path / 'run'}"),
                            cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=environment())
    assert result.returncode != 0
    assert ("error: trainer.prompts_per_step=3 does not split into whole prompt groups over 2 processes; use a "
            "multiple of 2") in result.stderr
    # Each rank stops with that one line; the only traceback is torchrun's own report of the failed ranks.
    assert "rlhf_lab/" not in "".join(line for line in result.stderr.splitlines() if line.lstrip().startswith("File"))
