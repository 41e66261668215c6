"""The GPU test's step on this CPU: what a decode leaves behind, and the trainer's real step against the plan.

    python -m benchmarks.step_memory decode --layers 16              # bytes a decode holds after it returns
    python -m benchmarks.step_memory step --layers 4                 # the real second step's peak vs the plan
    python -m benchmarks.step_memory calibration --new-tokens 48     # docs/guides/plan.md's calibration rows

Both run the ~1B Llama of ``tests/gpu/test_gpu.py`` (2048 wide, 5632 MLP, 16 heads, 8 key/value heads; fewer layers
on a small machine) in ``bf16-mixed`` (CPU autocast), 4 prompts × 4 samples × 64 new tokens, and count bytes as the
planner does: torch's ``MemTracker``, every live tensor storage (what a device allocator's peak counts).

- ``decode``: the decode loop (:func:`rlhf_lab.generation.decode.decode`) of 16 rows of 63 prompt tokens; prints
  its peak above the weights, what it holds while its output lives, and what stays once the output is gone.
- ``step``: ``Trainer.train_step`` twice at the GPU test's CUDA defaults (gradient checkpointing, chunked
  log-probs, a 16k-token budget); prints the second step's measured peak, ``plan_step``'s peak for the same config
  on fake tensors, and the plan's phases.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch

GIB = 1 << 30
WIDE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 8}


def decode_memory(layers: int, new_tokens: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_lab.generation.decode import decode
    from rlhf_lab.generation.kv_cache import decode_cache
    from rlhf_lab.planner.fake import StepMemory

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, num_hidden_layers=layers, tie_word_embeddings=True, **WIDE)
    model = LlamaForCausalLM(config).eval()
    with StepMemory() as memory:
        memory.track_external(model)
        prompts = torch.randint(5, 1000, (16, 63))
        mask = torch.ones_like(prompts)
        base = memory.start_phase()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            sampled = decode(model, prompts, mask, decode_cache(new_tokens), 0, max_new_tokens=new_tokens,
                             temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
        held = memory.current() - base
        del sampled
        gc.collect()
        left = memory.current() - base
        return (f"decode, {layers} layers, 16 rows x {new_tokens} tokens: peak above the weights "
                f"{(memory.phase_peak - base) / GIB:.3f} GiB; held with its output {held / GIB:.3f} GiB; "
                f"left after {left / GIB:.3f} GiB")


def step_memory(layers: int, new_tokens: int) -> str:
    from rlhf_lab.config import compose
    from rlhf_lab.planner.calibration import measured_step
    from rlhf_lab.planner.step import plan_step
    from rlhf_lab.training.loop import Trainer

    dims = [f"model.tiny.{key}={value}" for key, value in WIDE.items()] + [f"model.tiny.num_hidden_layers={layers}"]
    run = Path(tempfile.mkdtemp(prefix="step_memory_"))
    cfg = compose(["model=tiny", *dims, "trainer.gradient_checkpointing=true", "trainer.chunked_logprobs=true",
                   "trainer.max_tokens_per_micro_batch=16384", "trainer.precision=bf16-mixed", "trainer.eval_prompts=0",
                   "trainer.prompts_per_step=4", "algorithm.group_size=4", f"trainer.max_new_tokens={new_tokens}",
                   "reward=length", "trainer.seed_per_prompt=true", "trainer.steps=2", "trainer.progress_bar=false",
                   "logger=none", f"trainer.output_dir={run}"])
    start = time.perf_counter()
    trainer = Trainer(cfg, run)
    trainer.train_step(0)
    measured, width = measured_step(trainer, 1)
    plan = plan_step(cfg, trainer.tokenizer, trainer.precision, prompt_tokens=width, count_flops=False)
    phases = {name: round(value / GIB, 3) for name, value in plan.peaks.items()}
    return (f"step, {layers} layers: measured {measured / GIB:.3f} GiB, planned {plan.peak / GIB:.3f} GiB "
            f"({(plan.peak - measured) / measured:+.1%}); phases {phases}; {time.perf_counter() - start:.0f} s")


CALIBRATED = {"tiny fp32": ["trainer.precision=fp32"], "tiny bf16-mixed": ["trainer.precision=bf16-mixed"],
              "tiny fp32 LoRA": ["trainer.precision=fp32", "model.lora.enabled=true"],
              "tiny bf16-mixed LoRA": ["trainer.precision=bf16-mixed", "model.lora.enabled=true"]}


def calibration(new_tokens: int) -> str:
    """The plan against the trainer's real second step on this CPU (docs/guides/plan.md's calibration table): the
    tiny model, 2 prompts x 2 samples of the embedded data (prompts of several lengths: a left-padded batch),
    ``new_tokens`` per response; one line per config."""
    from rlhf_lab.config import compose
    from rlhf_lab.planner.calibration import measured_step
    from rlhf_lab.planner.step import plan_step
    from rlhf_lab.training.loop import Trainer

    lines = []
    for name, settings in CALIBRATED.items():
        run = Path(tempfile.mkdtemp(prefix="step_memory_"))
        cfg = compose(["model=tiny", *settings, "trainer.prompts_per_step=2", "algorithm.group_size=2",
                       f"trainer.max_new_tokens={new_tokens}", "trainer.eval_prompts=0", "trainer.steps=2",
                       "trainer.progress_bar=false", "trainer.num_threads=1", "logger=none", f"trainer.output_dir={run}"])
        try:
            trainer = Trainer(cfg, run)
            trainer.train_step(0)
            measured, width = measured_step(trainer, 1)
            trainer.close()
        finally:
            shutil.rmtree(run, ignore_errors=True)
        start = time.perf_counter()
        plan = plan_step(cfg, trainer.tokenizer, trainer.precision, prompt_tokens=width, count_flops=False)
        lines.append(f"{name}, {width} + {new_tokens} tokens: measured {measured / 2**20:.1f} MiB, planned "
                     f"{plan.peak / 2**20:.1f} MiB ({plan.peak_phase}), {(plan.peak - measured) / measured:+.1%}, "
                     f"plan {time.perf_counter() - start:.1f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("decode", "step", "calibration"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.what == "calibration":
        print(calibration(args.new_tokens))
        return
    print((decode_memory if args.what == "decode" else step_memory)(args.layers, args.new_tokens))


if __name__ == "__main__":
    main()
