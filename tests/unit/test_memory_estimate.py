"""The memory estimate of a run, by hand on the tiny model's shapes: parameter counts from the config alone,
bytes of weights, gradients, AdamW, reference and one micro-batch's activations, and the one-line refusal."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.errors import ConfigError
from rlhf_lab.training import memory_check
from rlhf_lab.training.memory_check import ModelSize, check_memory, estimate_memory, model_size

# model=tiny: SmolLM2's vocabulary, hidden 64, 2 layers, 4 heads of 16 (2 key/value heads: 32 wide), MLP 128.
V, H, KV, MLP, L = 49152, 64, 32, 128, 2
PER_LAYER = H * H + 2 * H * KV + H * H + 3 * H * MLP + 2 * H  # q, k and v, o, gate/up/down, two norms = 36,992
TINY_PARAMETERS = V * H + L * PER_LAYER + H  # tied embeddings and head, final norm = 3,219,776
R = 16  # model.lora.r, on q, k, v, o, gate, up and down
TINY_ADAPTER = L * R * ((H + H) + 2 * (H + KV) + (H + H) + 3 * (H + MLP))  # 32,768
TINY = ModelSize(TINY_PARAMETERS, 0, V, H, L)
ROWS, TOKENS = 4, 36  # trainer.micro_batch_size=4; data.max_prompt_tokens=32 + trainer.max_new_tokens=4
SETTINGS = ["model=tiny", "trainer.micro_batch_size=4", "data.max_prompt_tokens=32", "trainer.max_new_tokens=4"]
FULL_FP32 = 92_780_800  # 5 x 12,879,104 (weights, gradients, reference, AdamW's two moments) + 28,385,280


def test_parameters_are_counted_from_the_config_without_weights(compose, tiny_tokenizer) -> None:
    assert (TINY_PARAMETERS, TINY_ADAPTER) == (3_219_776, 32_768)
    assert model_size(compose(["model=tiny"]).model, tiny_tokenizer) == ModelSize(TINY_PARAMETERS, 0, V, H, L, 2048)
    lora = compose(["model=tiny", "model.lora.enabled=true"]).model
    assert model_size(lora, tiny_tokenizer) == ModelSize(TINY_PARAMETERS, TINY_ADAPTER, V, H, L, 2048)


def test_no_row_is_counted_longer_than_the_models_context(compose, tiny_tokenizer) -> None:
    """A prompt limit above the context (2048 tokens) is estimated at the context; the prompt is refused later."""
    cfg = compose(["model=tiny", "trainer.micro_batch_size=4", "data.max_prompt_tokens=100000"])
    estimate = check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"))
    assert estimate.activations == 4 * 2048 * (V + L * H) * 4


def test_full_fine_tuning_in_fp32_holds_four_copies_and_the_logits() -> None:
    estimate = estimate_memory(TINY, weight_bytes=4, compute_bytes=4, rows=ROWS, tokens=TOKENS, reference=True)
    assert estimate.weights == estimate.gradients == estimate.reference == 12_879_104  # 3,219,776 x 4 bytes
    assert estimate.optimizer == 25_758_208  # two AdamW moments
    assert estimate.activations == 28_385_280  # 4 rows x 36 tokens x (49,152 logits + 2 x 64) x 4 bytes
    assert estimate.total == FULL_FP32


def test_lora_trains_the_adapter_only_and_keeps_no_reference_copy() -> None:
    size = ModelSize(TINY_PARAMETERS, TINY_ADAPTER, V, H, L)
    estimate = estimate_memory(size, weight_bytes=4, compute_bytes=2, rows=ROWS, tokens=TOKENS, reference=True)
    assert estimate.weights == 13_010_176  # (3,219,776 + 32,768) x 4
    assert (estimate.gradients, estimate.optimizer, estimate.reference) == (131_072, 262_144, 0)
    assert estimate.activations == 14_192_640  # bf16-mixed: the logits at 2 bytes
    assert estimate.total == 27_596_032


def test_fsdp_splits_the_states_and_a_reward_head_has_one_logit() -> None:
    estimate = estimate_memory(TINY, 4, 4, ROWS, TOKENS, reference=False, logits_width=1, shards=2)
    assert (estimate.weights, estimate.gradients, estimate.optimizer, estimate.reference) == (
        6_439_552, 6_439_552, 12_879_104, 0)
    assert estimate.activations == 4 * 36 * (1 + 2 * 64) * 4


def test_a_run_over_the_memory_available_is_refused_in_one_line(compose, tiny_tokenizer, monkeypatch) -> None:
    cfg = compose(SETTINGS)
    monkeypatch.setattr(memory_check, "available_memory", lambda device: FULL_FP32)
    assert check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu")).total == FULL_FP32
    monkeypatch.setattr(memory_check, "available_memory", lambda device: FULL_FP32 - 1)
    with pytest.raises(ConfigError) as raised:
        check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"))
    assert str(raised.value) == (
        "this run needs about 0.0864 GiB (weights 0.012, gradients 0.012, AdamW 0.024, reference 0.012, "
        "activations 0.0264), this machine has 0.0864 GiB available on cpu; lower the model's size or train an "
        "adapter (model.lora.enabled=true), or set trainer.skip_memory_check=true to start anyway"
    )
    skipped = compose([*SETTINGS, "trainer.skip_memory_check=true"])
    assert check_memory(skipped, tiny_tokenizer, torch.float32, None, torch.device("cpu")) is None


def test_large_micro_batches_are_named_when_activations_dominate(compose, tiny_tokenizer, monkeypatch) -> None:
    cfg = compose(["model=tiny", "trainer.prompts_per_step=32", "algorithm.group_size=2",
                   "trainer.micro_batch_size=64", "data.max_prompt_tokens=32", "trainer.max_new_tokens=4"])
    monkeypatch.setattr(memory_check, "available_memory", lambda device: 1 << 20)
    with pytest.raises(ConfigError, match=r"; lower trainer\.micro_batch_size \(now 64 rows\) or the tokens per row"):
        check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"))


def test_host_memory_is_read_from_proc_meminfo_without_psutil(tmp_path, monkeypatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:    1000 kB\n")
    monkeypatch.setattr(memory_check, "MEMINFO", meminfo)
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    assert memory_check.available_memory(torch.device("cpu")) == 1_024_000
    meminfo.write_text("nothing readable\n")
    assert memory_check.available_memory(torch.device("cpu")) is None


def test_a_rank_of_a_sharded_gpu_run_counts_its_own_micro_batch_in_head_chunks(compose, tiny_tokenizer,
                                                                               monkeypatch) -> None:
    """8 ranks under FSDP on 80 GB GPUs (a rank of torchrun: no plan, the estimate alone), 64 rows of 2048 tokens:
    each rank holds 8 rows, within CUDA's 16k-token budget, the LM head in 1024-position chunks, the reference in
    bfloat16. By hand on the tiny model's shapes (the same code counts a 7B model's)."""
    from rlhf_lab.runtime.precision import Precision

    monkeypatch.setattr(memory_check, "available_memory", lambda device: 79 << 30)
    cfg = compose(["model=tiny", "trainer.prompts_per_step=8", "algorithm.group_size=8", "data.max_prompt_tokens=1024",
                   "trainer.max_new_tokens=1024", "trainer.precision=bf16-mixed"])
    estimate = check_memory(cfg, tiny_tokenizer, torch.float32, torch.bfloat16, torch.device("cuda"), shards=8,
                            precision=Precision("bf16-mixed", "cuda"), processes=8)
    rows, tokens, width = 8, 2048, -(-1024 * V // (8 * 2048))  # a rank's 8 rows; one [1024, V] chunk over them
    assert estimate.activations == rows * tokens * (width + L * H) * 2
    assert estimate.reference == TINY_PARAMETERS * 2 // 8 and estimate.weights == TINY_PARAMETERS * 4 // 8
    # The same run as one process of the whole batch, whole logits: the old count, 64 rows of the vocabulary.
    whole = check_memory(cfg, tiny_tokenizer, torch.float32, torch.bfloat16, torch.device("cuda"), shards=8)
    assert whole.activations == 64 * tokens * (V + L * H) * 2


def test_a_colocated_vllm_share_that_cannot_start_beside_the_trainer_is_one_line() -> None:
    """vLLM starts where the free memory is at least gpu_memory_utilization × the GPU when its engine is built,
    after the trainer's weights and reference: 80 GiB, 78 free, 26 held leave 52 (0.65 of the GPU)."""
    gib = 1 << 30
    cfg = OmegaConf.create({"generation": {"name": "vllm", "gpu_memory_utilization": 0.9}})
    with pytest.raises(ConfigError) as caught:
        memory_check.check_engine_share(cfg, held=26 * gib, free=78 * gib, total=80 * gib)
    assert str(caught.value) == (
        "generation.gpu_memory_utilization=0.9 asks vLLM for 72 GiB of the 80 GiB GPU when its engine starts, and 78 "
        "GiB are free before the trainer's weights and reference take 26 GiB: at most 0.65 fits beside them (vLLM "
        "refuses to start otherwise); lower generation.gpu_memory_utilization, train an adapter "
        "(model.lora.enabled=true), set trainer.offload_reference=true, or sample on another GPU "
        "(generation=vllm_server)")
    fitting = OmegaConf.create({"generation": {"name": "vllm", "gpu_memory_utilization": 0.65}})
    assert memory_check.check_engine_share(fitting, held=26 * gib, free=78 * gib, total=80 * gib) is None
