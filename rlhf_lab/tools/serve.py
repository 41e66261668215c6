"""``rlhf-lab serve MODEL [--host H] [--port N] [--dtype D] [--max-model-len L] [--lora-rank R] [--compile]``: a vLLM
server the trainer's ranks generate on (``generation=vllm_server generation.url=http://H:N
generation.sync_folder=DIR``); see :mod:`rlhf_lab.generation.server`. MODEL is a model folder (``save_pretrained``)."""

from __future__ import annotations

import argparse
import sys

from rlhf_lab.app.help_text import plain
from rlhf_lab.errors import ToolError, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ToolError(message)


def main(args: list[str] | None = None) -> None:
    parser = _Parser(prog="rlhf-lab serve", description=plain(__doc__))
    parser.add_argument("model", help="the model folder the engine loads (the policy's initial weights)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=2048, help="prompt + response tokens")
    parser.add_argument("--lora-rank", type=int, default=0, help="the policy's LoRA rank (0: full weights)")
    parser.add_argument("--compile", action="store_true", help="vLLM's compiled mode (eager otherwise)")
    try:
        options = parser.parse_args(sys.argv[1:] if args is None else args)
        from rlhf_lab.generation.server import serve

        serve(options.model, options.host, options.port, options.dtype, not options.compile, options.max_model_len,
              options.lora_rank)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
