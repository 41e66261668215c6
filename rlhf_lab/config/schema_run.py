"""Structured configs of how a run runs: the trainer's loop, evaluation, the generation engine, the hardware profile.

Part of :mod:`rlhf_lab.config.schema` (the root :class:`~rlhf_lab.config.schema.Config` types its groups with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------------------ trainer


@dataclass
class TrainerConfig:
    steps: int = 30
    lr: float = 1e-5
    # Wall-clock budget (s) of the training steps, over every resumed segment: the run stops after the step
    # that reaches it, then ends as usual (rlhf_lab/training/budget.py). null: none. The LR schedule still
    # runs over trainer.steps: with a large trainer.steps a decaying schedule is cut short, not compressed.
    max_train_seconds: float | None = None
    prompts_per_step: int = 2
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eval_every: int = 0  # 0: only at the end
    eval_prompts: int = 16
    checkpoint_every: int = 0  # 0: only at the end
    keep_last_n: int = 2
    resume: str | None = None  # null | auto | path to a checkpoint folder
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto | fp32 | bf16-mixed | bf16-true | fp16-mixed (Lightning's names; rlhf_lab/runtime/precision.py). auto:
    # bf16-mixed where the device multiplies bfloat16 fast (CUDA with bf16; AVX512-BF16/AMX CPUs whose bf16
    # products measure at least as fast as fp32's), else fp32
    precision: str = "auto"
    dtype: str | None = None  # deprecated alias: float32 -> precision=fp32, bfloat16 -> precision=bf16-true
    strategy: str = "auto"  # auto | single | ddp | fsdp (rlhf_lab/runtime/distributed.py); auto: ddp under torchrun
    # How long (s) a rank waits for the others: at the rendezvous, in a collective, at the barrier while rank 0 writes
    # a checkpoint (raise it for checkpoints that take longer to write). A peer that never comes or stops taking
    # part ends the run with an error instead of a hang.
    collective_timeout_s: float = 600.0
    gradient_checkpointing: bool = False  # recompute activations in backward (transformers' own)
    # Submodules of every decoder layer recomputed in the backward pass instead of keeping their activations
    # (exact: rlhf_lab/models/recompute.py). null: the hardware profile's choice (hardware.recompute: both norms
    # and the MLP under full fine-tuning; none otherwise); []: none
    recompute: list[str] | None = None
    offload_reference: bool = False  # keep the frozen reference on the CPU between its passes
    skip_memory_check: bool = False  # start even when the memory estimate exceeds what the machine has
    peak_tflops: float | None = None  # the device's peak TFLOP/s for perf/mfu; null: a GPU's by its name (else none)
    logprob_chunk: int = 0  # rows per chunk of the reference scoring pass; 0: the whole batch at once
    seed_per_prompt: bool = False  # each prompt group samples from its own seeded generator (batch-independent)
    num_threads: int = 0  # torch intra-op threads; 0: torch's default
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (after warmup)
    max_grad_norm: float | None = 1.0
    micro_batch_size: int = 0  # samples per forward/backward; 0 = the whole mini-batch
    samples_per_step_logged: int = 2  # rows appended to samples.jsonl each step
    max_consecutive_skips: int = 5  # non-finite loss/gradient skips before the run stops
    progress_bar: bool = True
    exact_every: int = 1  # model=exact: steps between exact/* metrics (by enumeration); 0: the last step only
    output_dir: str | None = None  # null: Hydra's run folder


# ----------------------------------------------------------------------------------------------------- eval


@dataclass
class EvalConfig:
    """Held-out evaluation (rlhf_lab/training/evaluation.py): training's periodic one and ``rlhf-lab eval``."""

    prompts: int | None = None  # null: trainer.eval_prompts
    samples_per_prompt: int = 1
    temperature: float | None = None  # null: trainer.temperature
    top_p: float | None = None  # null: trainer.top_p
    greedy: bool = False  # the most likely token at every position
    rewards: list[str] = field(default_factory=list)  # extra eval-only reward options, each eval/reward/<name>/mean
    win_rate: bool = False  # the reference answers too: eval/win_rate under win_rate_reward
    win_rate_reward: str | None = None  # a reward option; null: the run's reward


# ------------------------------------------------------------------------------------------------ hardware


@dataclass
class HardwareConfig:
    """``hardware=default|cpu_tuned`` (rlhf_lab/hardware/): each field one piece of CPU tuning, off on the plain path."""

    name: str = "default"
    keep_freed_heap: bool = False  # glibc: mmap threshold fixed at 32 MiB, the heap never trimmed
    row_chunk: int = 0  # rows per [rows, V] chunk of the log-prob and KL passes; 0: the plain path's
    fast_draws: bool = False  # the decode's multinomial draws computed only where a token can win
    generation_weights: bool = False  # merged LoRA / cast frozen / oneDNN-packed weights while decoding
    recompute: bool = False  # trainer.recompute=null: norms and MLP recomputed under full fine-tuning
    preallocate_optimizer: bool = False  # AdamW's moments made before the first generation


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class GenerationConfig:
    """``generation=hf`` (rlhf_lab/generation/): the engine that samples the responses (registered kind ``generation``)."""

    name: str = "hf"
    # Where π_old comes from (rlhf_lab/training/scoring_pass.py): trainer (a no-grad pass of the training model) |
    # sampler (the engine's own log-probs) | auto (trainer unless the engine is hf and the precision fp32, and
    # under max_staleness=1)
    logprobs: str = "auto"
    stop: list[str] = field(default_factory=list)  # stop strings: a response ends once its text ends with one
    # 0: a step samples with the weights it trains; 1: the next step's batch is sampled while this one trains, one
    # update behind (rlhf_lab/training/ahead.py; algorithm.tis_cap corrects for it)
    max_staleness: int = 0


@dataclass
class VLLMGenerationConfig(GenerationConfig):
    """``generation=vllm`` (rlhf_lab/generation/vllm.py): vLLM colocated in the trainer's process, one engine per rank."""

    name: str = "vllm"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3  # of the GPU, for vLLM's weights and key/value cache (the rest trains)
    kv_cache_mib: int = 512  # on a CPU: vLLM's key/value cache
    enforce_eager: bool = True  # no CUDA graphs / torch.compile warm-up (minutes on a CPU)
    sleep: bool = True  # on a GPU: the engine gives its memory back between generations (vLLM's sleep mode)


@dataclass
class VLLMServerGenerationConfig(GenerationConfig):
    """``generation=vllm_server`` (rlhf_lab/generation/server.py): an ``rlhf-lab serve`` server generates."""

    name: str = "vllm_server"
    url: str = "http://127.0.0.1:8765"
    # folder: through sync_folder | collective: broadcast over a process group of the trainer's rank 0 and the
    # server (NCCL between GPUs, else gloo), at group_host:group_port (rank 0's address); LoRA adapters: the folder
    weight_sync: str = "folder"
    sync_folder: str | None = None  # a folder the trainer and the server both read: weights go through it
    group_host: str = "127.0.0.1"
    group_port: int = 29650
