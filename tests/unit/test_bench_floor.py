"""The bench's generation floor: the work of one generation phase by hand, and the bound it implies."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.bench_floor import (
    Floor,
    GenerationWork,
    ModelShape,
    floor_seconds,
    generation_floor_summary,
    matmul_flop_rate,
)


def test_model_shape_counts_every_weight_matrix_once_and_not_the_embedding_gather() -> None:
    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    shape = ModelShape.of(LlamaForCausalLM(config))
    head_dim = 16 // 4
    per_layer = (16 * 16 + 2 * (2 * head_dim) * 16 + 16 * 16  # q, k, v, o
                 + 3 * 16 * 24)  # gate, up, down
    assert shape.matrix_parameters == 2 * per_layer + 100 * 16  # + the (tied) LM head
    assert (shape.layers, shape.hidden_size) == (2, 16)


def test_generation_work_flops_and_weight_reads_by_hand() -> None:
    shape = ModelShape(matrix_parameters=1000, layers=2, hidden_size=8)
    work = GenerationWork(rows=4, prefill_tokens=2 * 5, prompt_width=5, decode_steps=3)
    matrices = 2 * 1000 * (10 + 4 * 3)
    pairs = 4 * (5 + 6 + 7) + 10 * 5 // 2
    assert work.flops(shape) == matrices + 4 * 2 * 8 * pairs
    assert work.weight_reads() == 4  # the prefill and three decode steps


@pytest.mark.parametrize(("bandwidth", "rate", "bound"), [(1e3, 1e12, "memory_s"), (1e12, 1e3, "compute_s")])
def test_the_floor_is_the_larger_bound(bandwidth: float, rate: float, bound: str) -> None:
    shape = ModelShape(matrix_parameters=1000, layers=2, hidden_size=8)
    work = GenerationWork(rows=4, prefill_tokens=10, prompt_width=5, decode_steps=3)
    floor = floor_seconds(work, shape, Floor(bandwidth, rate, "float32"), weight_bytes_per_parameter=4)
    assert floor["memory_s"] == pytest.approx(1000 * 4 * 4 / bandwidth)
    assert floor["compute_s"] == pytest.approx(work.flops(shape) / rate)
    assert floor["floor_s"] == floor[bound] and floor["decode_steps"] == 3


def test_generation_floor_summary_is_the_ratio_of_means() -> None:
    floors = [(2.0, {"floor_s": 0.5, "memory_s": 0.5, "compute_s": 0.1}),
              (4.0, {"floor_s": 1.5, "memory_s": 1.5, "compute_s": 0.2})]
    summary = generation_floor_summary(floors)
    assert summary["generation_floor_s_mean"] == pytest.approx(1.0)
    assert summary["generation_over_floor"] == pytest.approx(3.0)
    assert summary["generation_floor_bound"] == "memory"
    assert generation_floor_summary([]) == {}


def test_the_matmul_rate_is_positive_and_finite_in_each_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        rate = matmul_flop_rate(dtype, size=64, repeats=1)
        assert 0 < rate < float("inf")
