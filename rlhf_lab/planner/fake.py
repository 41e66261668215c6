"""Running the real step on fake tensors: a memory tracker with phase peaks, and a batch whose indices are real.

Under ``torch._subclasses.FakeTensorMode`` every tensor has a shape, a dtype and a device but no data, so a step of
a 7B model runs on this CPU in seconds and allocates nothing. Two things the step's code needs are handled here:

- :class:`StepMemory` is torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) counting the bytes of
  every live tensor storage, with the peak of the phase in progress (:meth:`StepMemory.start_phase`). Its per-module
  statistics are left out: the step calls the same layers several times (reference, scoring, training passes),
  which those statistics refuse. Under FSDP :class:`FSDPStepMemory` is torch's ``FSDPMemTracker`` the same way: it
  counts DTensors by their local shards and a collective's result once (the plain tracker counts the waited-on
  buffer of every all-gather again on fake tensors).
- :class:`RealIndices` keeps the batch's bookkeeping real: an operation whose tensor inputs are all real (token ids,
  masks, positions, row indices; none of them fake) runs on real data where its outputs are small, so lengths,
  unique prompts and micro-batch cuts come out as the run's would. Where the step reads one number of a fake
  tensor (``.item()`` of a loss, a gradient norm, "is any row still decoding?") the answer is the one a full-length,
  finite step gives: true, 1. Such a step decodes every row to ``trainer.max_new_tokens`` and applies its update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REAL_NUMEL = 1 << 22  # outputs of all-real operations up to this size are computed on real data (bookkeeping)
INDEX_DTYPES = (torch.int64, torch.int32, torch.bool)


def _step_memory_class(sharded: bool = False) -> type:
    """:class:`StepMemory` (``sharded``: :class:`FSDPStepMemory`), defined at first use: importing torch's
    ``MemTracker`` sets up its compiler, which writes ``TORCHINDUCTOR_CACHE_DIR``, and importing the package must change
    nothing in the process."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class PhasePeaks:
        """The peak of the current phase (bytes, all devices), without the trackers' per-module statistics."""

        phase_peak = 0

        # The per-module snapshots refuse a module called twice in one step; the totals need none of them.
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            pass

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def current(self) -> int:
            """Bytes of the live storages the tracker knows, all devices."""
            return sum(snapshot["Total"] for snapshot in self.get_tracker_snapshot("current").values())

        def start_phase(self) -> int:
            """Begin a phase: its peak starts at what is live now (returned)."""
            self.phase_peak = self.current()
            return self.phase_peak

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            total = sum(snapshot["Total"] for snapshot in self._curr_mem_snap.values())
            self.phase_peak = max(self.phase_peak, total)

    class StepMemory(PhasePeaks, MemTracker):
        """``MemTracker`` without its per-module statistics, with the peak of the current phase."""

    class FSDPStepMemory(PhasePeaks, FSDPMemTracker):
        """torch's ``FSDPMemTracker`` of an FSDP2 root module and its optimizer, with the peak of the current phase.

        Unlike the plain ``MemTracker`` it lets DTensor desugar into its local shards before counting (the sharding
        propagation's own fake tensors are not memory), and counts a collective's ``wait_tensor`` on fake tensors as
        the buffer it waits on, not as a new tensor: the all-gathered layers and reduce-scattered gradients are
        counted once. Its per-module FSDP snapshots are left out (the step runs the root module many times: the
        decode, the scoring and the training passes); the states held before the step (``track_external``) are
        counted as its own categories: sharded parameters and gradients, buffers, the optimizer's state."""

        def _register_module_and_optimizer_hooks(self) -> None:
            self._instrument_optimizer()

        def track_external(self, *external: Any) -> None:
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

            for item in external:
                if isinstance(item, torch.optim.Optimizer):
                    self._track_optimizer_states(_FSDPRefType.OPT, item)
                elif item is not None:
                    for parameter in item.parameters():
                        self._update_and_maybe_create_winfos(parameter, _FSDPRefType.SHARDED_PARAM)
                        if parameter.grad is not None:
                            self._update_and_maybe_create_winfos(parameter.grad, _FSDPRefType.SHARDED_GRAD)
                    for buffer in item.buffers():
                        self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    return FSDPStepMemory if sharded else StepMemory


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``StepMemory`` and ``FSDPStepMemory`` (see :func:`_step_memory_class`)."""
    if name in ("StepMemory", "FSDPStepMemory"):
        if name not in _LAZY:
            _LAZY[name] = _step_memory_class(sharded=name == "FSDPStepMemory")
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _answer(tensor: torch.Tensor) -> bool | int | float:
    """The value a full-length, finite step reads from a fake scalar."""
    if tensor.dtype == torch.bool:
        return True
    return 1.0 if tensor.is_floating_point() else 1


def _sampled(result: Any, token_id: int) -> Any:
    """A sampling operation's token ids made real (``token_id`` everywhere); other outputs as they are."""
    def real(tensor: torch.Tensor) -> torch.Tensor:
        with unset_fake_temporarily():
            return torch.full(tensor.shape, token_id, dtype=tensor.dtype)

    if isinstance(result, torch.Tensor):
        return real(result)
    values, indices = result  # max(dim): the values stay fake
    return type(result)((values, real(indices))) if hasattr(result, "_fields") else (values, real(indices))


class RealIndices(TorchDispatchMode):
    """Inside a ``FakeTensorMode``: all-real operations with small outputs on real data; a fake scalar read as
    :func:`_answer` says; tokens drawn from fake logits (``multinomial``, ``argmax``, ``max`` over a dimension) are
    real, ``token_id`` each (an ordinary token: no row ends). Enter it after the fake mode (and after any tracker),
    so it sees each operation first.

    :meth:`draws` ends a decode early: after ``count`` draws every row draws ``eos_token_id``, and ``on_draw`` is
    called at each draw (the planner reads the FLOP counter there)."""

    SAMPLING = (torch.ops.aten.multinomial.default, torch.ops.aten.argmax.default, torch.ops.aten.max.dim)

    def __init__(self, token_id: int, eos_token_id: int | None = None) -> None:
        super().__init__()
        self.token_id, self.eos_token_id = token_id, eos_token_id
        self.draws_left: int | None = None
        self.on_draw: Any = None

    @contextmanager
    def draws(self, count: int, on_draw: Any) -> Iterator[None]:
        self.draws_left, self.on_draw = count, on_draw
        try:
            yield
        finally:
            self.draws_left, self.on_draw = None, None

    def _drawn(self) -> int:
        if self.draws_left is None:
            return self.token_id
        self.draws_left -= 1
        self.on_draw()
        return self.token_id if self.draws_left > 0 or self.eos_token_id is None else self.eos_token_id

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return _answer(args[0])
        if any(isinstance(t, FakeTensor) for t in tensors):
            result = func(*args, **kwargs)
            return _sampled(result, self._drawn()) if func in self.SAMPLING else result
        try:  # the output's shape first, from the fake mode: a large one stays fake
            shaped = func(*args, **kwargs)
        except Exception:  # noqa: BLE001  (data-dependent shapes: only real data can say)
            shaped = None
        if shaped is not None:
            outputs = [t for t in tree_flatten(shaped)[0] if isinstance(t, torch.Tensor)]
            small = all(t.numel() <= REAL_NUMEL for t in outputs)
            # A factory (no tensor input) makes real data only for indices; a float one is a model's buffer.
            if not small or (not tensors and any(t.dtype not in INDEX_DTYPES for t in outputs)):
                return shaped
        with unset_fake_temporarily():
            return func(*args, **kwargs)
