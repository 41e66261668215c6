"""The planner's byte count (torch's ``MemTracker``, rlhf_lab/planner/fake.py) against torch's profiler on this CPU:
what a pass leaves allocated — a training pass with gradients in fp32 and under bf16 autocast, and the decode under
bf16 autocast — is, to the byte, the profiler's net allocation over the same code (``profile_memory``: every
allocation and free the allocator saw), and after the training pass exactly the gradients. A tracker that counted a
freed buffer as held would plan memory no run holds.

Each case runs in a fresh process: the profiler's net also counts the free of anything allocated before it started
(an earlier test's garbage), which no tracker of this code could see. The tracker's one over-count found here: it
counts a storage when it first sees it, so a tensor made before the count and first read inside it (the decode's
prompts: 512 bytes) is counted as made there; told to the tracker up front (``track_external``, as the planner does
with the models, the reference and the optimizer) it is not."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.limits import HANG_GUARD_S


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def held_by_both(model: torch.nn.Module, work, warm_up, inputs: tuple[torch.Tensor, ...] = ()) -> tuple[int, int]:
    """(bytes the tracker counts as left by ``work``, the profiler's net allocation over it), after ``warm_up``;
    ``inputs``: tensors made before and read by ``work``, told to the tracker up front (it counts a storage when it
    first sees it)."""
    from torch.profiler import ProfilerActivity, profile

    from rlhf_lab.planner.fake import StepMemory

    warm_up()
    gc.collect()
    with StepMemory() as memory:
        memory.track_external(model, *inputs)
        before = memory.current()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            work()
            gc.collect()
        tracked = memory.current() - before
    return tracked, sum(event.self_cpu_memory_usage for event in profiler.events())


def measure(case: str) -> dict[str, int]:
    model = tiny_llama()
    if case in ("fp32", "bf16"):
        ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))

        def training_pass() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16"):
                logits = model(input_ids=ids).logits
                loss = logits.float().logsumexp(-1).mean()
            loss.backward()  # the graph's saved tensors go; the gradients stay

        tracked, profiled = held_by_both(model, training_pass, lambda: (training_pass(), model.zero_grad(True)))
        return {"tracked": tracked, "profiled": profiled,
                "gradients": sum(p.numel() * p.element_size() for p in model.parameters())}
    from rlhf_lab.generation.decode import decode
    from rlhf_lab.generation.kv_cache import decode_cache

    model.eval()
    prompts = torch.randint(5, 500, (4, 16), generator=torch.Generator().manual_seed(1))
    kept = []

    def sampling() -> None:
        torch.manual_seed(0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            kept.append(decode(model, prompts, torch.ones_like(prompts), decode_cache(8), 0, max_new_tokens=8,
                               temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0))

    tracked, profiled = held_by_both(model, sampling, lambda: (sampling(), kept.clear()), (prompts,))
    return {"tracked": tracked, "profiled": profiled}


def measured(case: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-m", "tests.unit.test_memtracker_profiler", case], capture_output=True,
                          text=True, timeout=HANG_GUARD_S, check=False, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_a_pass_with_gradients_leaves_what_the_profiler_counts(case: str) -> None:
    result = measured(case)
    assert result["tracked"] == result["profiled"] == result["gradients"]  # nothing of the graph stays


def test_the_decode_leaves_what_the_profiler_counts() -> None:
    result = measured("decode")
    assert result["tracked"] == result["profiled"] > 0  # its outputs, held by the caller; no step's activations


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])))
