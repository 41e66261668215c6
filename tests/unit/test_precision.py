"""precision: Lightning's names, the deprecated trainer.dtype alias, and what each mode does to weights and compute."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.errors import ConfigError
from rlhf_lab.precision import Precision, check_device, fast_bf16, resolve_precision


@pytest.mark.parametrize(("precision", "dtype", "expected"), [
    ("fp32", None, "fp32"), ("bf16-mixed", None, "bf16-mixed"), ("bf16-true", None, "bf16-true"),
    ("fp32", "float32", "fp32"), ("fp32", "bfloat16", "bf16-true"), ("bf16-true", "bfloat16", "bf16-true"),
])
def test_precision_and_its_alias(precision: str, dtype: str | None, expected: str) -> None:
    assert resolve_precision(precision, dtype, warn=False) == expected


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_mixed_only_where_bf16_is_native(monkeypatch, native: bool) -> None:
    """auto: bf16-mixed on a CPU with AVX512-BF16 or AMX, fp32 on one without (emulated bf16 is slower)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert fast_bf16(torch.device("cpu")) is native
    assert resolve_precision("auto", None, warn=False) == ("bf16-mixed" if native else "fp32")
    assert resolve_precision("auto", "bfloat16", warn=False) == "bf16-true"  # the explicit alias wins
    assert fast_bf16(torch.device("meta")) is False


def test_auto_is_the_default_and_tiny_tests_pin_fp32(compose, tiny_overrides) -> None:
    assert compose([]).trainer.precision == "auto"
    assert compose(tiny_overrides(None)).trainer.precision == "fp32"


def test_the_alias_prints_one_deprecation_line(capsys) -> None:
    assert resolve_precision("fp32", "bfloat16") == "bf16-true"
    assert capsys.readouterr().err == (
        "trainer.dtype is deprecated: trainer.dtype=bfloat16 means trainer.precision=bf16-true; use that\n"
    )


@pytest.mark.parametrize(("precision", "dtype", "message"), [
    ("fp64", None, "trainer.precision='fp64' is not valid; choose from: auto, fp32, bf16-mixed, bf16-true, fp16-mixed"),
    ("fp32", "int8", "trainer.dtype='int8' is not valid; choose from: float32, bfloat16, float16"),
    ("fp32", "float16", "trainer.dtype=float16 (pure float16 weights) is replaced by trainer.precision=fp16-mixed"),
    ("bf16-mixed", "bfloat16", "trainer.dtype=bfloat16 (= trainer.precision=bf16-true) contradicts "
                               "trainer.precision=bf16-mixed; set trainer.precision only"),
])
def test_bad_precisions_are_one_line_errors(precision: str, dtype: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_precision(precision, dtype, warn=False)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_fp16_mixed_needs_cuda() -> None:
    with pytest.raises(ConfigError, match=r"^trainer.precision=fp16-mixed needs a CUDA device \(got "
                                          r"trainer.device=cpu\); on a CPU use trainer.precision=bf16-mixed$"):
        check_device("fp16-mixed", torch.device("cpu"))
    check_device("bf16-mixed", torch.device("cpu"))


def test_mixed_keeps_fp32_weights_and_computes_in_bf16() -> None:
    trainer = OmegaConf.create({"precision": "bf16-mixed", "dtype": None})
    precision = Precision.from_config(trainer, torch.device("cpu"))
    assert precision.weights_dtype == "float32"
    layer = torch.nn.Linear(4, 4)
    with precision.autocast():
        out = layer(torch.ones(1, 4))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    assert precision.grad_scaler() is None
    true = Precision.from_config(OmegaConf.create({"precision": "bf16-true", "dtype": None}), torch.device("cpu"))
    assert true.weights_dtype == "bfloat16"
    with true.autocast():
        assert layer(torch.ones(1, 4)).dtype == torch.float32  # no autocast: the weights' own dtype
