"""vLLM's own log lines during a run (``generation=vllm``): to the run's log file, counted in one console line.

vLLM configures its ``vllm`` logger when it is imported (``VLLM_CONFIGURE_LOGGING=1``, its default): a handler of
its own on stdout at ``VLLM_LOGGING_LEVEL`` (INFO), not propagating to the root logger, so a two-step run printed
hundreds of lines and none reached the job's ``<name>.log``. While a run's engine lives, :class:`VLLMLogs` keeps
only vLLM's errors on the console (its handler raised to ERROR) and sends every record to the log files of the root
logger (Hydra's job log); at the end :meth:`VLLMLogs.close` puts vLLM's handlers back as they were and returns one
line with the counts. Nothing changes the process environment (vLLM reads its variables at its own import), and
``VLLM_CONFIGURE_LOGGING=0`` (vLLM leaves its logger alone) is respected: then there is nothing to route.
Without a log file (the Python API outside Hydra, a test) the console stays as vLLM set it.

One vLLM line is dropped, not routed: ``RotaryEmbedding: Failed to load weights`` at every weight sync. It is not
a failed load. vLLM's layer-wise reload counts a layer's buffers as loadable, and a rotary layer's only tensor is
its ``cos_sin_cache``, a non-persistent buffer computed from the config at start (no checkpoint has it; the
trainer's rotary ``inv_freq`` is not sent either). When a reload brings nothing for it, vLLM warns and puts the
layer's own tensors back (``_place_kernel_tensors``), so the cache it samples with is unchanged. The filter drops
that line for rotary layers only; the same line for any other layer still reaches the log and the count.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

VLLM_LOGGER = "vllm"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # where the reload's line is logged
ROTARY_LINE = re.compile(r"\w*Rotary\w*: Failed to load weights$")


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's reload warning for rotary-embedding layers (see the module: their cache is kept, not lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if ROTARY_LINE.match(record.getMessage()):
            self.dropped += 1
            return False
        return True


class _ToFiles(logging.Handler):
    """Counts every vLLM record and hands it to the root logger's file handlers."""

    def __init__(self, files: list[logging.Handler]) -> None:
        super().__init__(logging.NOTSET)
        self.files, self.counts = files, Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] += 1
        for handler in self.files:
            if record.levelno >= handler.level:
                handler.handle(record)


class VLLMLogs:
    """vLLM's records to the run's log file while installed (see the module); :meth:`close` undoes it."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(VLLM_LOGGER)
        self.rotary = RotaryReloadFilter()
        logging.getLogger(RELOAD_LOGGER).addFilter(self.rotary)
        self.files = [h for h in logging.getLogger().handlers
                      if isinstance(h, logging.FileHandler) and h.baseFilename != os.devnull]
        self.levels = {handler: handler.level for handler in self.logger.handlers}
        self.routed = _ToFiles(self.files) if self.files and self.levels else None
        if self.routed is not None:
            for handler in self.levels:
                handler.setLevel(max(handler.level, logging.ERROR))
            self.logger.addHandler(self.routed)

    def close(self) -> str | None:
        """vLLM's logging as it was; the console line that says what went to the log file (None: nothing did)."""
        logging.getLogger(RELOAD_LOGGER).removeFilter(self.rotary)
        if self.routed is None:
            return None
        self.logger.removeHandler(self.routed)
        for handler, level in self.levels.items():
            handler.setLevel(level)
        counts = self.routed.counts
        if not counts:
            return None
        told = ", ".join(f"{counts[level]} {level.lower()}" for level in sorted(counts, key=logging.getLevelName,
                                                                               reverse=True))
        where = ", ".join(h.baseFilename for h in self.files)  # type: ignore[attr-defined]
        return f"vLLM wrote {told} lines to {where} (its errors also print here)"
