"""``rlhf-lab serve MODEL [--sync-folder DIR] [--host H] [--port N] [--dtype D] [--gpu-memory-utilization F]
[--trainer-host H] [--token-file F] [--max-model-len L] [--lora-rank R] [--compile] [--engine vllm|hf]``: a
server the trainer's ranks generate on (``generation=vllm_server generation.url=http://H:N
generation.sync_folder=DIR``), which also answers OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` with
the sampled token ids and log-probs (agent programs, ``env=verifiers``); see :mod:`rlhf_lab.generation.serving` for
whom it lets in and what it loads. MODEL is a model folder (``save_pretrained``, with its tokenizer)."""

from __future__ import annotations

import argparse
import sys

from rlhf_lab.app.help_text import plain
from rlhf_lab.errors import ToolError, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ToolError(message)


def main(args: list[str] | None = None) -> None:
    from rlhf_lab.generation.serve_engine import DEFAULT_MEMORY_SHARE, DTYPES, REQUEST_SECONDS
    from rlhf_lab.generation.serving import TOKEN_ENV, TOKEN_FILE

    parser = _Parser(prog="rlhf-lab serve", description=plain(__doc__))
    parser.add_argument("model", help="the model folder the engine loads (the policy's initial weights)")
    parser.add_argument("--sync-folder", default=None,
                        help=f"the trainer's generation.sync_folder: weights are loaded only from inside it, and the "
                             f"token is written there ({TOKEN_FILE}, mode 0600); without it the server loads no "
                             f"weights from folders (to serve only), and the token comes from --token-file or "
                             f"{TOKEN_ENV}")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback: a warning)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto: bfloat16 on a GPU (the trainer's default precision), float32 on a CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_MEMORY_SHARE,
                        help="the GPU's share for weights and KV cache, in (0, 1] (default fits a 7B policy beside "
                             "its trainer on 80 GB)")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="on a CPU: the KV cache")
    parser.add_argument("--trainer-host", default="127.0.0.1",
                        help="the only address /open_group dials (generation.group_host)")
    parser.add_argument("--token-file", default=None,
                        help=f"read the shared secret from this file (default: {TOKEN_ENV}, else a new one)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="prompt + response tokens")
    parser.add_argument("--lora-rank", type=int, default=0, help="the policy's LoRA rank (0: full weights)")
    compiled = parser.add_mutually_exclusive_group()
    compiled.add_argument("--compile", action="store_true",
                          help="vLLM's compiled mode (CUDA graphs) everywhere (default: on a GPU only)")
    compiled.add_argument("--eager", action="store_true",
                          help="vLLM's eager mode everywhere (default: on a CPU only, where compiling takes minutes)")
    parser.add_argument("--request-seconds", type=float, default=REQUEST_SECONDS,
                        help="--engine hf: a request still sampling after this many seconds is stopped with a 408, "
                             "so no request holds the engine past it (vLLM's requests are bounded by their tokens)")
    parser.add_argument("--engine", default="vllm", choices=("vllm", "hf"),
                        help="vllm (the vLLM extra), or hf: transformers' model sampled as generation=hf does (no "
                             "extra needed; full weights only)")
    try:
        options = parser.parse_args(sys.argv[1:] if args is None else args)
        from rlhf_lab.generation.serve_engine import HFServerEngine, VLLMServerEngine
        from rlhf_lab.generation.serving import serve

        kind = HFServerEngine if options.engine == "hf" else VLLMServerEngine

        if not options.request_seconds > 0:
            raise ToolError(f"--request-seconds {options.request_seconds:g} is out of range; must be > 0")

        def engine(model, dtype, eager, length, rank, share):  # noqa: ANN001, ANN202  (serve's factory)
            built = kind(model, dtype, eager, length, rank, share, options.kv_cache_mib)
            built.request_seconds = options.request_seconds
            return built

        serve(options.model, options.host, options.port, options.dtype, eager(options), options.max_model_len,
              options.lora_rank, sync_folder=options.sync_folder, token_file=options.token_file,
              trainer_host=options.trainer_host, memory_share=options.gpu_memory_utilization, engine_factory=engine)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("rlhf-lab serve: stopped (Ctrl-C)", file=sys.stderr)
        sys.exit(130)


def eager(options: argparse.Namespace) -> bool:
    """vLLM's eager mode: ``--eager``, ``--compile``, else as ``generation.enforce_eager`` defaults (CUDA graphs on a
    GPU, eager on a CPU)."""
    if options.eager or options.compile:
        return bool(options.eager)
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    main()
