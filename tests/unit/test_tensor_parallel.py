"""``generation.tensor_parallel_size`` under a launch of several ranks: the ranks of a group send the group's prompts
to their engine in rank order, with one seed per group, and each keeps its own outputs (two gloo ranks on the
stand-in vLLM of tests/fake_vllm.py); a size that does not divide the ranks is one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.vllm import TensorParallel
from tests.limits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]

RANK = r"""
import json, sys
import torch, torch.distributed as dist
from tests import fake_vllm
from tests.conftest import compose
from rlhf_lab.generation import vllm as engine_module
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.models import loading

sys.modules.update(fake_vllm.modules())  # import vllm: the stand-in
dist.init_process_group("gloo", init_method=sys.argv[3], rank=int(sys.argv[2]), world_size=2)
rank = dist.get_rank()
cfg = compose(["model=tiny", "trainer.precision=fp32"])
tokenizer = loading.load_tokenizer(cfg.model)
policy = loading.build_tiny_llama(tokenizer, cfg.model.tiny, seed=0).eval()
engine = engine_module.VLLMGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=4, max_prompt_tokens=64),
                                      options={"tensor_parallel_size": 2})
mine = [["Hi there"], ["Say something kind.", "Name a colour."]][rank]
seeds = [[5], [6, 7]][rank]
rollout = engine.generate(mine, 2, seeds=seeds)
calls, tokens = [], []
original = fake_vllm.LLM.generate
def recording(self, prompts, params, **kwargs):
    calls.append([p["prompt_token_ids"] for p in prompts])
    tokens.append([p.max_tokens for p in params])
    return original(self, prompts, params, **kwargs)
fake_vllm.LLM.generate = recording
again = engine.generate(mine, 2, seeds=seeds)
# A later turn of a multi-turn batch: each rank asks for as many tokens as its own rows have left.
turn = engine.generate(mine, 1, seeds=seeds, settings=SamplingSettings(max_new_tokens=[3, 2][rank], max_prompt_tokens=64))
json.dump({"rows": rollout.batch_size, "same": bool(torch.equal(rollout.input_ids, again.input_ids)),
           "turn_tokens": tokens[1], "turn_width": turn.response_ids.shape[1],
           "seed": fake_vllm.LLM.built[-1].kwargs["seed"], "sent": calls[0],
           "mine": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in mine],
           "prompts": [row[rollout.attention_mask[i, :rollout.prompt_width].bool()].tolist()
                       for i, row in enumerate(rollout.input_ids[:, :rollout.prompt_width])]},
          open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_ranks_share_one_engine_s_requests_and_keep_their_own_outputs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / f"rank{r}.json"), str(r), address],
                              cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errors = [rank.communicate(timeout=HANG_GUARD_S)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["rows"] == 2 and second["rows"] == 4  # each rank its own prompts' samples
    assert first["sent"] == second["sent"] == first["mine"] + second["mine"]  # the group's prompts, in rank order
    assert first["seed"] == second["seed"] == 0  # one seed per group
    assert first["prompts"] == [ids for ids in first["mine"] for _ in range(2)]
    assert second["prompts"] == [ids for ids in second["mine"] for _ in range(2)]
    assert first["same"] and second["same"]
    # Each rank's prompts sampled with its own settings, the same requests on both ranks.
    assert first["turn_tokens"] == second["turn_tokens"] == [3, 2, 2]
    assert first["turn_width"] <= 3 and second["turn_width"] <= 2


def test_a_size_that_does_not_divide_the_ranks_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^generation.tensor_parallel_size=2 does not divide the 1 ranks"):
        TensorParallel(2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=0"):
        TensorParallel(0)


def test_an_evaluation_samples_in_lockstep_where_an_engine_spans_ranks() -> None:
    """An evaluation's ranks pad their prompts to as many chunks as the rank with the most where a forward or an
    engine call is collective: FSDP's sharded weights, or a tensor-parallel group's engine (33 prompts over 2 ranks
    would otherwise send 2 chunks from one rank and 1 from the other, and the group's engine would wait)."""
    from types import SimpleNamespace

    import torch

    from rlhf_lab.training.evaluation import in_lockstep

    policy = torch.nn.Linear(2, 2)
    assert not in_lockstep(SimpleNamespace(engine=SimpleNamespace(), policy=policy))  # hf: no group
    assert not in_lockstep(SimpleNamespace(engine=SimpleNamespace(tensor_parallel=SimpleNamespace(size=1)),
                                           policy=policy))
    assert in_lockstep(SimpleNamespace(engine=SimpleNamespace(tensor_parallel=SimpleNamespace(size=2)), policy=policy))
