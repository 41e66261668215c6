"""precision: Lightning's names, the deprecated trainer.dtype alias, and what each mode does to weights and compute."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.errors import ConfigError
from rlhf_lab.runtime import precision as precision_module
from rlhf_lab.runtime.precision import Precision, check_device, fast_bf16, resolve_precision


@pytest.mark.parametrize(("precision", "dtype", "expected"), [
    ("fp32", None, "fp32"), ("bf16-mixed", None, "bf16-mixed"), ("bf16-true", None, "bf16-true"),
    ("fp32", "float32", "fp32"), ("fp32", "bfloat16", "bf16-true"), ("bf16-true", "bfloat16", "bf16-true"),
])
def test_precision_and_its_alias(precision: str, dtype: str | None, expected: str) -> None:
    assert resolve_precision(precision, dtype, warn=False) == expected


@pytest.mark.parametrize(("native", "pays", "expected"), [
    (True, True, "bf16-mixed"), (True, False, "fp32"), (False, True, "fp32"), (False, False, "fp32")])
def test_auto_is_bf16_mixed_only_where_bf16_products_are_native_and_fast(monkeypatch, native: bool, pays: bool,
                                                                        expected: str) -> None:
    """auto: bf16-mixed on a CPU with AVX512-BF16 or AMX whose bf16 products are at least as fast as its float32
    ones; fp32 on one without (emulated bf16) or where they are slower (measured)."""
    measured = []
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(precision_module, "bf16_products_pay", lambda threads: measured.append(threads) or pays)
    assert fast_bf16(torch.device("cpu")) is (expected == "bf16-mixed")
    assert measured == ([torch.get_num_threads()] if native else [])  # no measuring without the instructions
    assert resolve_precision("auto", None, warn=False) == expected
    assert resolve_precision("auto", "bfloat16", warn=False) == "bf16-true"  # the explicit alias wins
    assert fast_bf16(torch.device("meta")) is False


class _Clock:
    """A fake ``perf_counter`` that each fake product advances by the next of its dtype's costs."""

    def __init__(self, costs: dict[torch.dtype, list[float]]) -> None:
        self.now, self.costs, self.calls = 0.0, {dtype: list(c) for dtype, c in costs.items()}, []

    def perf_counter(self) -> float:
        return self.now

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.dtype, weight.dtype, tuple(x.shape), tuple(weight.shape)))
        self.now += self.costs[x.dtype].pop(0)
        return x[:, :1]


# Six calls per dtype: a warm-up (free here, so counting it would tie every case) and five timed ones.
@pytest.mark.parametrize(("fp32_s", "bf16_s", "pays"), [
    ([0, 2, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1], True),
    ([0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], True),  # a tie: bf16 (half the memory)
    ([0, 1, 1, 1, 1, 1], [0, 1.8, 1.8, 1.8, 1.8, 1.8], False),
    ([0, 1, 1, 1, 1, 1], [0, 9, 9, 0.9, 9, 9], True),  # the best of the five, not their mean
    ([0, 3, 3, 1, 3, 3], [0, 2, 2, 2, 2, 2], False),
])
def test_the_bf16_probe_compares_the_best_product_times(monkeypatch, fp32_s: list[float], bf16_s: list[float],
                                                        pays: bool) -> None:
    clock = _Clock({torch.float32: fp32_s, torch.bfloat16: bf16_s})
    monkeypatch.setattr(precision_module.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(torch.nn.functional, "linear", clock.linear)
    state = torch.get_rng_state()
    assert precision_module.measure_bf16_products() is pays
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not touched
    rows, inputs, outputs = precision_module.PROBE_SHAPE
    assert clock.calls == [(dtype, dtype, (rows, inputs), (outputs, inputs))
                           for dtype in (torch.float32, torch.bfloat16) for _ in range(6)]


@pytest.fixture
def probe_cache(monkeypatch, tmp_path):
    """The answers file in a fresh cache folder, the in-process memo cleared, and a counted fake measurement."""
    monkeypatch.setenv("RLHF_LAB_CACHE", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(precision_module, "measure_bf16_products", lambda: measured.append(1) or len(measured) == 1)
    precision_module.bf16_products_pay.cache_clear()
    yield tmp_path / "cache" / precision_module.PRODUCTS_FILE, measured
    precision_module.bf16_products_pay.cache_clear()


def test_the_bf16_answer_is_measured_once_per_machine_and_read_back(probe_cache) -> None:
    """The first process measures and writes the answer; later ones (the memo cleared) read it, so every job of
    a sweep on this machine gets the same precision; another thread count is another entry."""
    path, measured = probe_cache
    assert precision_module.bf16_products_pay(2) is True and measured == [1]
    key = precision_module._cpu_key(2)
    assert key.endswith(f" | torch {torch.__version__} | 2 threads") and precision_module.cpu_name() in key
    assert json.loads(path.read_text()) == {key: True}
    precision_module.bf16_products_pay.cache_clear()  # a new process
    assert precision_module.bf16_products_pay(2) is True and measured == [1]  # read, not measured
    assert precision_module.bf16_products_pay(1) is False and measured == [1, 1]  # the fake's second answer
    assert json.loads(path.read_text()) == {key: True, key.replace("2 threads", "1 threads"): False}


def test_a_broken_or_unwritable_answers_file_means_measuring(probe_cache) -> None:
    path, measured = probe_cache
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert precision_module.bf16_products_pay(2) is True and measured == [1]
    assert len(json.loads(path.read_text())) == 1  # rewritten whole
    precision_module.bf16_products_pay.cache_clear()
    path.unlink()
    path.mkdir()  # a folder where the file should be: nothing can be written
    assert precision_module.bf16_products_pay(2) is False and measured == [1, 1]
    assert precision_module.bf16_products_pay(2) is False and measured == [1, 1]  # once per process


@pytest.mark.parametrize(("device", "asked"), [("cpu", [True]), ("meta", [])])
def test_auto_s_measured_answer_is_agreed_across_ranks(monkeypatch, device: str, asked: list[bool]) -> None:
    """On a CPU the ranks agree (bf16 only where every rank measured it fast); elsewhere nothing is asked."""
    monkeypatch.setattr(precision_module, "fast_bf16", lambda device: device.type == "cpu")
    calls = []
    assert resolve_precision("auto", None, warn=False, device=torch.device(device),
                             agree=lambda flag: calls.append(flag) or False) == "fp32"
    assert calls == asked
    assert resolve_precision("fp32", None, warn=False, agree=lambda flag: calls.append(flag)) == "fp32"
    assert calls == asked  # an explicit precision asks no rank


def test_the_trainer_makes_its_ranks_agree_on_auto(compose, tiny_overrides, tmp_path, monkeypatch) -> None:
    from rlhf_lab.training import loop

    monkeypatch.setattr(precision_module, "fast_bf16", lambda device: True)
    monkeypatch.setattr(loop.distributed, "all_reduce_flags", lambda flag: False)  # another rank measured slower
    trainer = loop.Trainer(compose([*tiny_overrides(None), "trainer.precision=auto"]), tmp_path / "run")
    assert trainer.precision.name == "fp32"


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


def test_validating_a_config_measures_nothing(compose, monkeypatch) -> None:
    """Config validation leaves ``auto`` unresolved: a bad config fails at start with nothing measured or
    written to the cache folder; the run resolves it when it starts."""
    from rlhf_lab.config.validate import validate

    def measured(threads: int) -> bool:
        raise AssertionError("auto was measured during validation")

    monkeypatch.setattr(precision_module, "fast_bf16", lambda device: measured(1))
    validate(compose([]))
    with pytest.raises(AssertionError, match="measured during validation"):
        Precision.from_config(compose([]).trainer, torch.device("cpu"))
    with pytest.raises(ConfigError, match="trainer.precision='fp64' is not valid"):
        validate(compose(["trainer.precision=fp64"]))
