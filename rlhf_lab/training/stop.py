"""How a run stops on a signal: the first SIGINT/SIGTERM finishes the step and checkpoints, on every rank at once."""

from __future__ import annotations

import signal
import sys
from typing import Any

import torch

from rlhf_lab.errors import TrainingStopped
from rlhf_lab.runtime import distributed


class StopSignals:
    """The :class:`~rlhf_lab.training.loop.Trainer`'s signal handling and the agreement of the ranks on stopping."""

    def _handle_signal(self, signum: int, frame: Any) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, stop. A second one aborts at once."""
        name = signal.Signals(signum).name
        if self.stop_signal is not None:
            raise KeyboardInterrupt(f"second {name}")
        self.stop_signal = signum
        self.stop_requested = f"received {name}"
        print(f"received {name}: finishing the current step, then writing a checkpoint "
              f"(send it again to abort without one)", file=sys.stderr, flush=True)

    def agree_on_stop(self) -> bool:
        """Whether every rank stops after this step: when any rank was asked to (a scheduler or a user may signal
        one process of a torchrun launch only), all checkpoint and stop together instead of the others waiting in
        the next step's collectives. A rank stopped by another's signal names it and exits with its status."""
        requested = self.stop_requested is not None  # read before the signal: the handler sets the signal first
        local = torch.tensor([[float(requested), float(self.stop_signal or 0)]], dtype=torch.float64)
        every_rank = distributed.gather_rows(local)  # [world_size, 2]: one collective, on every rank at this point
        signalled = every_rank[:, 1].nonzero().flatten().tolist()
        if self.stop_signal is None and signalled:
            sender = signalled[0]
            self.stop_signal = int(every_rank[sender, 1])
            self.stop_requested = f"rank {sender} received {signal.Signals(self.stop_signal).name}"
        return bool(every_rank.any())

    def _stopped(self, step: int) -> TrainingStopped:
        resume = ("trainer.resume=auto", f"trainer.output_dir={self.run_dir.resolve()}")
        message = (f"stopped after step {step}: {self.stop_requested}; checkpoint "
                   f"{self.checkpoint_root / f'step_{step + 1}'} written; continue with: {' '.join(resume)}")
        exit_code = 128 + self.stop_signal if self.stop_signal is not None else 3
        return TrainingStopped(message, exit_code=exit_code, resume_overrides=resume)
