"""vLLM's own log lines during a run (``generation=vllm``): to the run's log file, counted in one console line.

vLLM configures its ``vllm`` logger when it is imported (``VLLM_CONFIGURE_LOGGING=1``, its default): a handler of
its own on stdout at ``VLLM_LOGGING_LEVEL`` (INFO), not propagating to the root logger, so a two-step run printed
hundreds of lines and none reached the job's ``<name>.log``. While a run's engine lives, :class:`VLLMLogs` keeps
only vLLM's errors on the console and sends every record to the log files of the root logger (Hydra's job log):
the engine is built with vLLM's own ``LoggingConfig(configure_logging=False)`` (so vLLM adds no console handler;
one an earlier engine of the process added is raised to ERROR), and the ``vllm`` logger gets a handler that counts
and writes to those files. At the end :meth:`VLLMLogs.close` puts vLLM's logger back as it was and returns one line
with the counts. Nothing changes the process environment; a user's ``VLLM_CONFIGURE_LOGGING=0`` or
``VLLM_LOGGING_CONFIG_PATH`` is respected (vLLM's logging is then theirs), and without a log file (the Python API
outside Hydra) the console stays as vLLM sets it.

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
    """Counts every vLLM record and hands it to the root logger's file handlers (and an error to its console ones
    too, where vLLM has no console handler of its own)."""

    def __init__(self, files: list[logging.Handler], consoles: list[logging.Handler]) -> None:
        super().__init__(logging.NOTSET)
        self.files, self.consoles, self.counts = files, consoles, Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] += 1
        for handler in self.files + (self.consoles if record.levelno >= logging.ERROR else []):
            if record.levelno >= handler.level:
                handler.handle(record)


def _routed() -> bool:
    """Whether vLLM's lines are ours to route: vLLM would configure its logger itself (``VLLM_CONFIGURE_LOGGING``
    not 0) from no logging config file of the user's."""
    return os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and not os.environ.get("VLLM_LOGGING_CONFIG_PATH")


class VLLMLogs:
    """vLLM's records to the run's log file while installed (see the module); :meth:`close` undoes it. Built before
    vLLM is imported (its import logs too); the engine is built with :meth:`engine_kwargs`."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(VLLM_LOGGER)
        self.rotary = RotaryReloadFilter()
        reload_logger = logging.getLogger(RELOAD_LOGGER)
        for stale in [f for f in reload_logger.filters if isinstance(f, RotaryReloadFilter)]:
            reload_logger.removeFilter(stale)  # an earlier engine's of this process that was never closed
        reload_logger.addFilter(self.rotary)
        vllm_logger = logging.getLogger(VLLM_LOGGER)
        for stale in [h for h in vllm_logger.handlers if isinstance(h, _ToFiles)]:
            vllm_logger.removeHandler(stale)  # likewise: one run's routing at a time
        root = logging.getLogger().handlers
        self.files = [h for h in root if isinstance(h, logging.FileHandler) and h.baseFilename != os.devnull]
        consoles = [h for h in root if not isinstance(h, logging.FileHandler)]
        self.levels = {handler: handler.level for handler in self.logger.handlers}  # vLLM's own, if it set them up
        self.propagate = self.logger.propagate
        self.routed = _ToFiles(self.files, [] if self.levels else consoles) if self.files and _routed() else None
        if self.routed is not None:
            for handler in self.levels:
                handler.setLevel(max(handler.level, logging.ERROR))
            self.logger.addHandler(self.routed)
            self.logger.propagate = False

    def engine_kwargs(self) -> dict[str, object]:
        """What ``vllm.LLM`` is built with: while routed, vLLM does not configure its logger (its ``dictConfig``
        would put its console handler back)."""
        if self.routed is None:
            return {}
        from vllm.config.logging import LoggingConfig

        return {"logging_config": LoggingConfig(configure_logging=False)}

    def close(self) -> str | None:
        """vLLM's logging as it was; the console line that says what went to the log file (None: nothing did)."""
        logging.getLogger(RELOAD_LOGGER).removeFilter(self.rotary)
        if self.routed is None:
            return None
        self.logger.removeHandler(self.routed)
        self.logger.propagate = self.propagate
        for handler, level in self.levels.items():
            handler.setLevel(level)
        counts = self.routed.counts
        if not counts:
            return None
        told = ", ".join(f"{counts[level]} {level.lower()}" for level in sorted(counts, key=logging.getLevelName,
                                                                               reverse=True))
        where = ", ".join(h.baseFilename for h in self.files)  # type: ignore[attr-defined]
        return f"vLLM wrote {told} lines to {where} (its errors also print here)"
