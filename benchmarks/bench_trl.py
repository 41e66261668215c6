"""The TRL side of ``rlhf-lab bench``: the same GRPO run in TRL's ``GRPOTrainer``, timed per step and phase.

Imported only when a comparison with TRL is asked for; ``trl`` itself is imported inside the functions
that need it, so :func:`unsupported_reason` and :func:`ppo_status` answer without loading it.

What is kept identical to rlhf_lab's run of the same config (``cfg``, composed and validated):
model files (the cached SmolLM2 folder, or the tiny Llama saved with the same seed), tokenizer and chat
template with ``model.system_prompt``, the prompts of each step (rlhf_lab's ``prompt_indices`` order,
TRL's shuffling off), samples per step (``trainer.prompts_per_step`` × ``algorithm.group_size``),
``max_completion_length``, temperature/top-p/top-k, learning rate, schedule and AdamW settings, gradient
clipping, clip epsilon, group-std scaling, token-mean loss (TRL's ``dapo``), k3 KL in the loss with
``beta = kl.coef``, LoRA settings, precision (rlhf_lab's ``bf16-mixed``, also what ``auto`` resolves to on
bfloat16 hardware, is TRL's ``bf16=True`` autocast; ``fp32`` and ``bf16-true`` run without autocast in the
weights' dtype), reward (rlhf_lab's reward wrapped as a TRL reward function). TRL defaults that differ from
rlhf_lab's and are switched off here: gradient checkpointing, dataset shuffling; AdamW is the fused torch kernel on both sides. Left as TRL has it:
its fused LM head (log-probs computed in tiles without materialising [B, T, V] logits).

Per-step phases, measured around TRL's own methods: ``generate`` (``_generate``: prompt tokenisation,
``model.generate``, decoding), ``reward`` (``_calculate_rewards``), ``reference`` (reference log-probs:
``_get_per_token_logps_and_entropies`` without gradient), ``advantages`` (the rest of
``_prepare_inputs``: advantages, masks, metrics), ``policy_forward_backward`` (``training_step`` minus
``_prepare_inputs``) and ``optimizer`` (the rest of the step: clipping, ``optimizer.step``, scheduler).
"""

from __future__ import annotations

import importlib.util
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_format import PHASES  # noqa: F401  (the phases timed on both sides)


def trl_version() -> str | None:
    """The installed TRL version, or None when TRL is not installed (read without importing it)."""
    if importlib.util.find_spec("trl") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def ppo_status() -> str:
    """Why there is no TRL PPO row: TRL's PPO trainer is absent, or cannot take the settings rlhf_lab uses."""
    installed = trl_version()
    if installed is None:
        return "TRL is not installed"
    import trl

    # Looked up as a folder: importing trl.experimental just to ask would print its instability warning.
    has_ppo = hasattr(trl, "PPOTrainer") or (Path(trl.__file__).parent / "experimental" / "ppo").is_dir()
    if not has_ppo:
        return (f"TRL {installed} has no PPO trainer (neither trl.PPOTrainer nor trl.experimental.ppo exists); "
                "only rlhf_lab's PPO is timed")
    return (f"TRL {installed}'s PPOTrainer takes a reward model (an nn.Module scoring token ids) and a separate value "
            "model, not a reward function, so it cannot run the VADER reward with matching settings; only "
            "rlhf_lab's PPO is timed")


def unsupported_reason(cfg: Any) -> str | None:
    """Why ``cfg`` has no equivalent TRL GRPOTrainer run, or None when it has one."""
    if trl_version() is None:
        return "TRL is not installed (pip install 'rlhf_lab[trl]' or -r requirements-trl.txt)"
    algorithm, kl, trainer = cfg.algorithm, cfg.kl, cfg.trainer
    if algorithm.name == "ppo":
        return ppo_status()
    samples = trainer.prompts_per_step * algorithm.group_size
    checks = [
        (algorithm.name != "grpo", f"algorithm={algorithm.name} has no TRL counterpart here (only grpo is compared)"),
        (algorithm.advantage != "grpo",
         f"algorithm.advantage={algorithm.advantage} (TRL GRPO uses the group-normalised advantage)"),
        (algorithm.whiten_advantages or algorithm.weight_by != "advantage" or algorithm.clamp_negative_weights,
         "advantage whitening/reweighting options have no TRL GRPO setting"),
        (algorithm.clip_eps is None, "algorithm.clip_eps=null (TRL GRPO always clips)"),
        (algorithm.mini_batch_size not in (0, samples), "algorithm.mini_batch_size below the rollout size"),
        (algorithm.entropy_coef > 0, "algorithm.entropy_coef > 0 is not mapped to TRL"),
        (kl.name not in ("k3", "none") and kl.coef > 0, f"kl={kl.name}: TRL GRPO's KL term is k3 only"),
        (kl.name == "k3" and kl.coef > 0 and kl.placement != "loss", "kl.placement=reward: TRL GRPO puts k3 in the loss"),
        (kl.controller != "fixed", "kl.controller=adaptive has no TRL GRPO setting"),
        (trainer.device not in ("auto", "cpu", "cuda"), f"trainer.device={trainer.device} (use auto, cpu or cuda)"),
    ]
    for failed, reason in checks:
        if failed:
            return reason
    return None


def grpo_config_kwargs(cfg: Any, total_steps: int, output_dir: str) -> dict[str, Any]:
    """GRPOConfig arguments equal to ``cfg``'s settings (see the module docstring for what is matched)."""
    from rlhf_lab.config.validate_scale import planned_device

    algorithm, kl, trainer = cfg.algorithm, cfg.kl, cfg.trainer
    samples = trainer.prompts_per_step * algorithm.group_size
    micro = trainer.micro_batch_size or samples
    clip_low = algorithm.clip_eps_low if algorithm.clip_eps_low is not None else algorithm.clip_eps
    clip_high = algorithm.clip_eps_high if algorithm.clip_eps_high is not None else algorithm.clip_eps
    return {
        "output_dir": output_dir,
        "max_steps": total_steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": samples // micro,
        "num_generations": algorithm.group_size,
        "max_completion_length": trainer.max_new_tokens,
        "temperature": trainer.temperature,
        "top_p": trainer.top_p,
        "top_k": trainer.top_k,
        "learning_rate": trainer.lr,
        "lr_scheduler_type": trainer.lr_schedule,
        "warmup_steps": trainer.warmup_steps,
        "weight_decay": trainer.weight_decay,
        "adam_beta1": trainer.adam_beta1,
        "adam_beta2": trainer.adam_beta2,
        "max_grad_norm": trainer.max_grad_norm or 0.0,  # 0 turns clipping off
        "optim": "adamw_torch_fused",  # rlhf_lab uses torch.optim.AdamW(fused=True) too
        "beta": kl.coef if kl.name == "k3" else 0.0,
        "epsilon": clip_low,
        "epsilon_high": clip_high,
        "num_iterations": algorithm.epochs,
        "scale_rewards": "group" if algorithm.scale_by_std else "none",
        "loss_type": "dapo" if algorithm.loss_aggregation == "token_mean" else "grpo",
        "model_init_kwargs": {"dtype": weights_dtype(trainer)},
        "bf16": run_precision(trainer) == "bf16-mixed",
        "fp16": False,
        "activation_checkpointing": False,  # TRL's default is on (its alias gradient_checkpointing=True)
        "dataloader_pin_memory": False,
        "use_cpu": planned_device(trainer.device).type == "cpu",  # auto on a machine without CUDA too
        "shuffle_dataset": False,
        "seed": cfg.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "log_completions": False,
    }


def step_prompts(cfg: Any, total_steps: int) -> tuple[list[str], list[Any]]:
    """(raw prompts, TRL dataset prompts) in the order rlhf_lab's trainer draws them, step by step.

    With the chat template on, TRL gets conversations (system message when ``model.system_prompt`` is set,
    then the user prompt) and applies the tokenizer's template itself, as rlhf_lab's ``format_prompts`` does.
    """
    from rlhf_lab.data.prompts import load_prompts, prompt_indices

    train = load_prompts(cfg.data, seed=cfg.seed).train
    raw = [train[i] for step in range(total_steps)
           for i in prompt_indices(step, cfg.trainer.prompts_per_step, len(train), cfg.seed)]
    if not cfg.model.chat_template:
        return raw, list(raw)
    system = [{"role": "system", "content": cfg.model.system_prompt}] if cfg.model.system_prompt else []
    return raw, [[*system, {"role": "user", "content": prompt}] for prompt in raw]


def prompt_ids_match(cfg: Any, tokenizer: Any, raw_prompt: str, trl_prompt: Any) -> bool:
    """Whether TRL's tokenisation of a prompt equals rlhf_lab's (``format_prompts`` + no special tokens)."""
    from rlhf_lab.data.prompts import format_prompts

    ours = tokenizer(format_prompts([raw_prompt], tokenizer, cfg.model.chat_template, cfg.model.system_prompt),
                     add_special_tokens=False)["input_ids"][0]
    if isinstance(trl_prompt, str):
        theirs = tokenizer(text=[trl_prompt])["input_ids"][0]
    else:
        theirs = tokenizer.apply_chat_template(conversation=[trl_prompt], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"][0]
    return list(ours) == list(theirs)


def reward_function(cfg: Any) -> Any:
    """rlhf_lab's configured reward as a TRL reward function ``f(prompts, completions, **kwargs) -> list[float]``."""
    from rlhf_lab.rewards.base import build_reward

    reward = build_reward(cfg.reward)

    def text(item: Any) -> str:
        if isinstance(item, str):
            return item
        contents = [m["content"] for m in item if m.get("role") in ("user", "assistant")]
        return contents[-1] if contents else ""

    def score(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        return reward([text(p) for p in prompts], [text(c) for c in completions]).scores.tolist()

    score.__name__ = cfg.reward.name
    return score


def run_precision(trainer: Any) -> str:
    """The precision rlhf_lab's run resolves to (``trainer.precision``, ``auto`` for the planned device)."""
    from rlhf_lab.config.validate_scale import planned_device
    from rlhf_lab.runtime.precision import resolve_precision

    return resolve_precision(trainer.precision, trainer.dtype, warn=False, device=planned_device(trainer.device))


def weights_dtype(trainer: Any) -> str:
    """The dtype name of the weights rlhf_lab trains in."""
    from rlhf_lab.runtime.precision import WEIGHT_DTYPES

    return WEIGHT_DTYPES[run_precision(trainer)]


def model_folder(cfg: Any, tokenizer: Any, work_dir: Path) -> str:
    """A folder TRL can load the policy (and its reference) from: the same weights rlhf_lab starts from."""
    from rlhf_lab.models.loading import DTYPES, build_tiny_llama, smollm2_model_path

    if cfg.model.name == "tiny":
        folder = work_dir / "tiny_model"
        build_tiny_llama(tokenizer, cfg.model.tiny, seed=cfg.seed).to(DTYPES[weights_dtype(cfg.trainer)]).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return str(folder)
    return cfg.model.name_or_path or str(smollm2_model_path())


def _timed_trainer_class() -> type:
    """GRPOTrainer with wall-clock timers around the methods that make up a step."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def bench_reset(self) -> None:
            self.bench_times: dict[str, float] = defaultdict(float)
            self.bench_tokens = 0

        @contextmanager
        def bench_phase(self, name: str) -> Iterator[None]:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.bench_times[name] += time.perf_counter() - start

        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            with self.bench_phase("generate"):
                return super()._generate(*args, **kwargs)

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            with self.bench_phase("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # the policy's forward inside the loss: part of training_step
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with self.bench_phase("reference"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
            output = super()._generate_and_score_completions(*args, **kwargs)
            # Prompt plus response tokens, EOS included: what rlhf_lab's tokens/s counts.
            self.bench_tokens += int(output["prompt_mask"].sum() + output["completion_mask"].sum())
            return output

        def _prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
            with self.bench_phase("prepare"):
                return super()._prepare_inputs(*args, **kwargs)

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            with self.bench_phase("training_step"):
                return super().training_step(*args, **kwargs)

    return TimedGRPOTrainer


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _step_record(times: dict[str, float], step_s: float, tokens: int) -> dict[str, Any]:
    prepare, training = times.get("prepare", 0.0), times.get("training_step", 0.0)
    measured = {name: times.get(name, 0.0) for name in ("generate", "reward", "reference")}
    phases = {
        **measured,
        "advantages": max(0.0, prepare - sum(measured.values())),
        "policy_forward_backward": max(0.0, training - prepare),
        "optimizer": max(0.0, step_s - training),
        "sync_weights": 0.0,  # TRL generates with the model itself here (no engine to sync)
    }
    return {"step_s": step_s, "phases": phases, "tokens": tokens, "reward_mean": float("nan")}


def run_trl(cfg: Any, steps: int, warmup: int, work_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ``warmup + steps`` steps with TRL's GRPOTrainer; (per-step records, facts about the run).

    Each record: ``step_s``, ``phases`` (seconds by :data:`PHASES`), ``tokens`` (prompt + response tokens),
    ``reward_mean`` (TRL's logged ``reward``). The caller drops the first ``warmup`` records.
    """
    reason = unsupported_reason(cfg)
    if reason is not None:
        raise RuntimeError(reason)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from rlhf_lab.models.loading import load_tokenizer
    from rlhf_lab.runtime.versions import environment
    from rlhf_lab.step.compute import attention_implementation

    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    total = warmup + steps
    tokenizer = load_tokenizer(cfg.model)
    raw, prompts = step_prompts(cfg, total)
    args = GRPOConfig(**grpo_config_kwargs(cfg, total, str(work_dir / "out")))
    peft_config = None
    if cfg.model.lora.enabled:
        from peft import LoraConfig

        lora = cfg.model.lora
        peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    records: list[dict[str, Any]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _synchronize()
            trainer.bench_reset()
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _synchronize()
            step_s = time.perf_counter() - self.start
            records.append(_step_record(trainer.bench_times, step_s, trainer.bench_tokens))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if records and logs and "reward" in logs:
                records[-1]["reward_mean"] = float(logs["reward"])

    trainer = _timed_trainer_class()(
        model=model_folder(cfg, tokenizer, work_dir),
        reward_funcs=reward_function(cfg),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[StepClock()],
    )
    trainer.bench_reset()
    ready = time.perf_counter()
    trainer.train()
    facts = {
        "ready_at": ready,
        "trl_version": trl_version(),
        "trainer": "trl.GRPOTrainer",
        "prompt_ids_match": prompt_ids_match(cfg, tokenizer, raw[0], prompts[0]),
        "device": str(trainer.accelerator.device),
        "versions": environment(trainer.accelerator.device.type, attention_implementation(trainer.model)),
    }
    return records, facts
