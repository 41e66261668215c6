"""Speed and memory settings that change no number: logits scaled without a division at temperature 1, and the
process defaults rlhf_lab sets at import (PyTorch's huge-page allocator switch, oneDNN's per-shape cache at one
entry), which the bench leaves out of TRL's runs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

import rlhf_lab
import rlhf_lab.allocator
from rlhf_lab.ops import scale_logits
from rlhf_lab.tools import bench

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
MALLINFO = """
import ctypes, json
libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    raise SystemExit(3)
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
"""

def test_scale_logits_skips_the_division_at_temperature_one() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert scale_logits(logits, 1.0) is logits  # float32 in, nothing allocated
    assert torch.equal(scale_logits(logits, 1.0), logits / 1.0)  # x / 1 is x exactly
    assert torch.equal(scale_logits(logits, 0.7), logits / 0.7)
    half = logits.bfloat16()
    assert scale_logits(half, 1.0).dtype == torch.float32
    assert torch.equal(scale_logits(half, 1.0), half.float())


THP, LRU = "THP_MEM_ALLOC_ENABLE", "LRU_CACHE_CAPACITY"
PROBE = ("import json, os, rlhf_lab; "
         "print(json.dumps([{n: os.environ[n] for n in rlhf_lab.PROCESS_DEFAULTS}, rlhf_lab.DEFAULTED]))")


def _imported(env: dict[str, str]) -> list:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_importing_rlhf_lab_sets_its_process_defaults_unless_the_environment_has_them() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (THP, LRU)}
    assert _imported(env) == [{THP: "1", LRU: "1"}, {THP: True, LRU: True}]
    assert _imported({**env, THP: "0", LRU: "64"}) == [{THP: "0", LRU: "64"}, {THP: False, LRU: False}]


def test_the_one_entry_cache_keeps_less_of_each_new_shape() -> None:
    """Products of ever new shapes (as every step's new prompt and response lengths make) leave their set-ups and
    buffers in PyTorch's per-shape oneDNN cache; at rlhf_lab's one entry the heap keeps about half as much (the
    rest is oneDNN's own cache of compiled kernels, which the decode loop needs)."""
    code = MALLINFO + """
import torch
torch.set_num_threads(1)
weight = torch.randn(576, 1536, requires_grad=True)
def run(rows):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(torch.randn(rows, 1536), weight)
for rows in range(64, 70):
    run(rows)
before = libc.mallinfo2().uordblks
for rows in range(70, 110):
    run(rows)
print(libc.mallinfo2().uordblks - before)
"""
    if not (GLIBC and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN's bf16 products on glibc only")
    env = {k: v for k, v in os.environ.items() if k != LRU}

    def growth(capacity: str) -> int:
        return int(_probe(code, {**env, LRU: capacity}))

    kept_one, kept_default = growth("1"), growth("1024")
    assert kept_one < 0.75 * kept_default, (kept_one, kept_default)  # measured here: 12.6 vs 23.4 MiB for 40 shapes


@pytest.mark.parametrize("defaulted", [True, False])
def test_the_bench_runs_trl_without_rlhf_lab_s_defaults(monkeypatch, tmp_path, defaulted: bool) -> None:
    environments = {}

    def fake_run(command, env, **kwargs):
        environments[command[-2]] = env
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(rlhf_lab, "DEFAULTED", {THP: defaulted, LRU: defaulted})
    monkeypatch.setenv(THP, "1")
    monkeypatch.setenv(LRU, "1")
    for framework in ("rlhf_lab", "trl"):
        result = bench.run_job(bench.Job("grpo_full", framework, [], 1, 0), tmp_path)
        assert result["error"].startswith("child exited with status 1")
    ours, theirs = (environments[str(tmp_path / name)] for name in ("grpo_full_rlhf_lab_0.job.json",
                                                                      "grpo_full_trl_1.job.json"))
    assert (ours[THP], ours[LRU]) == ("1", "1")
    assert (theirs[THP], theirs[LRU]) == (("0", "1024") if defaulted else ("1", "1"))  # a user's setting is kept
    assert theirs == bench.child_environment("trl") and ours == bench.child_environment("rlhf_lab")


def test_the_trl_child_keeps_the_library_defaults_although_it_imports_rlhf_lab(monkeypatch) -> None:
    monkeypatch.setattr(rlhf_lab, "DEFAULTED", {THP: True, LRU: True})
    monkeypatch.setenv(THP, "1")  # what importing rlhf_lab set in this process
    monkeypatch.setenv(LRU, "1")
    code = f"import os, rlhf_lab.tools.bench; print(os.environ['{THP}'], os.environ['{LRU}'])"
    for framework, expected in (("trl", ["0", "1024"]), ("rlhf_lab", ["1", "1"])):
        env = bench.child_environment(framework)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == expected


HEAP_PROBE = MALLINFO + """
from rlhf_lab import allocator
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
took = allocator.keep_freed_heap()
mapped_before = libc.mallinfo2().hblkhd
block = libc.malloc(24 << 20)
mapped = libc.mallinfo2().hblkhd - mapped_before
libc.free(block)
print(json.dumps({"took": took, "mapped": mapped, "heap_after_free": libc.mallinfo2().arena}))
"""


def _probe(code: str, env: dict[str, str]) -> str:
    """stdout of ``code`` (which starts with MALLINFO) run in a fresh process; skipped without ``mallinfo2``."""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if result.returncode == 3:
        pytest.skip("this C library has no mallinfo2")
    assert result.returncode == 0, result.stderr
    return result.stdout


def _probe_heap(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in rlhf_lab.allocator.USER_SWITCHES}
    env.pop("GLIBC_TUNABLES", None)
    return json.loads(_probe(HEAP_PROBE, {**env, **env_extra}))


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_a_training_process_keeps_freed_memory_in_the_heap() -> None:
    probe = _probe_heap({})
    assert probe["took"] is True
    assert probe["mapped"] == 0  # 24 MiB came from the heap, not from a fresh mmap
    assert probe["heap_after_free"] >= 24 << 20  # and the heap was not trimmed after it was freed


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_glibc_s_own_switches_in_the_environment_stand() -> None:
    probe = _probe_heap({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert probe["took"] is False
    assert probe["mapped"] >= 24 << 20  # glibc's defaults: a request this large is mapped


def test_the_trainer_sets_the_process_up(monkeypatch) -> None:
    from omegaconf import OmegaConf

    from rlhf_lab.training import loop

    calls = []
    monkeypatch.setattr(loop.allocator, "keep_freed_heap", lambda: calls.append("heap") or True)
    monkeypatch.setattr(loop.torch, "set_num_threads", lambda n: calls.append(n))
    loop.configure_process(OmegaConf.create({"num_threads": 0}))
    loop.configure_process(OmegaConf.create({"num_threads": 3}))
    assert calls == ["heap", 3, "heap"]


def test_the_bench_records_each_framework_s_allocator_settings(monkeypatch) -> None:
    for name in rlhf_lab.allocator.USER_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(rlhf_lab, "DEFAULTED", {THP: True, LRU: True})
    monkeypatch.setenv(THP, "1")
    monkeypatch.setenv(LRU, "1")
    environment = bench._environment()
    assert environment["thp_mem_alloc"] == {"rlhf_lab": "1", "trl": "0"}
    assert environment["onednn_lru_cache"] == {"rlhf_lab": "1", "trl": "1024"}
    assert environment["freed_heap_kept"] == {"rlhf_lab": sys.platform.startswith("linux"), "trl": False}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert bench._environment()["freed_heap_kept"] == {"rlhf_lab": False, "trl": False}
