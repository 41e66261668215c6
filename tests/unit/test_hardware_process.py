"""Process settings: nothing at import; what a run's hardware profile asks for (glibc's heap kept between steps),
only for that run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from rlhf_lab.hardware import HardwareProfile, allocator

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

THP, LRU = "THP_MEM_ALLOC_ENABLE", "LRU_CACHE_CAPACITY"  # what an import once set
IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
import torch  # read for its globals below; nothing else first, so what any import sets shows
before = dict(os.environ)
state = lambda: {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                 "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
                 "deterministic": torch.are_deterministic_algorithms_enabled(),
                 "matmul": torch.get_float32_matmul_precision(), "flush_denormal": torch.set_flush_denormal(False)}
torch_before = state()
import rlhf_lab
modules = [name for _, name, _ in pkgutil.walk_packages(rlhf_lab.__path__, "rlhf_lab.")
           if ".conf" not in name and not name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)
changed = {k: os.environ.get(k) for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
print(json.dumps({"modules": len(modules), "environment": changed, "torch": [torch_before, state()]}))
"""


def test_importing_every_module_changes_nothing_in_the_process() -> None:
    """``import rlhf_lab`` and every submodule: no environment variable, thread count or torch global changes,
    the libraries' own imports included (``transformers``' model classes would set up torch's compiler, which
    writes ``TORCHINDUCTOR_CACHE_DIR``: they are imported where a model is built)."""
    # This test process has imported them already: the probe starts without what that set.
    env = {k: v for k, v in os.environ.items() if k not in (THP, LRU, "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], env=env, capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["modules"] > 90  # every module of the package was imported
    assert probe["environment"] == {}
    assert probe["torch"][0] == probe["torch"][1]


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_importing_every_module_leaves_the_heap_as_glibc_sets_it() -> None:
    """After every module is imported a 24 MiB request is still mapped afresh: no mallopt ran at import."""
    code = MALLINFO + """
import importlib, pkgutil
import rlhf_lab
for _, name, _ in pkgutil.walk_packages(rlhf_lab.__path__, "rlhf_lab."):
    if ".conf" not in name and not name.endswith("__main__"):
        importlib.import_module(name)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
before = libc.mallinfo2().hblkhd
libc.malloc(24 << 20)
print(libc.mallinfo2().hblkhd - before)
"""
    assert int(_probe(code, _without_heap_switches()).strip().splitlines()[-1]) >= 24 << 20


HEAP_PROBE = MALLINFO + """
from rlhf_lab.hardware import allocator
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
    return json.loads(_probe(HEAP_PROBE, {**_without_heap_switches(), **env_extra}))


def _without_heap_switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (*allocator.USER_SWITCHES, "GLIBC_TUNABLES")}


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

    from rlhf_lab.training import setup as loop

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_heap", lambda: calls.append("heap") or True)
    monkeypatch.setattr(loop.torch, "set_num_threads", lambda n: calls.append(n))
    loop.configure_process(OmegaConf.create({"num_threads": 0}), HardwareProfile())
    loop.configure_process(OmegaConf.create({"num_threads": 3}), HardwareProfile(keep_freed_heap=True))
    assert calls == [3, "heap"]  # the plain path keeps glibc's own heap settings
