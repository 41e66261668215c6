"""``rlhf-lab plan`` against the step it predicts: its peak within 15% of the real CPU step's, and its one-line refusals.

The measured peak is the trainer's own second step (``Trainer.train_step``: generation, reward, scoring pass,
update; the optimizer's state from the first step) on real tensors, under the same byte count the plan uses (torch's
``MemTracker``: the bytes of every live tensor storage, what a device allocator's peak counts). The plan runs the same
config on fake tensors, at the prompt width the real batch had.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest
import torch

from rlhf_lab.models.loading import DTYPES
from rlhf_lab.planner import calibration
from rlhf_lab.planner.step import plan_step, synthetic_prompts
from rlhf_lab.runtime.versions import device_name
from rlhf_lab.training.loop import Trainer
from tests.limits import HANG_GUARD_S

SHORT = ["trainer.prompts_per_step=2", "algorithm.group_size=2", "trainer.max_new_tokens=4", "trainer.eval_prompts=0",
         "trainer.progress_bar=false", "trainer.num_threads=1", "trainer.steps=2"]


def measured_step(cfg, run_dir) -> tuple[int, int, Trainer]:
    """(bytes at the peak of the real second step, its prompt width, the trainer)."""
    trainer = Trainer(cfg, run_dir)
    trainer.train_step(0)
    return (*calibration.measured_step(trainer, 1), trainer)


@pytest.mark.parametrize("settings", [
    ["model=tiny", "trainer.precision=fp32"],
    ["model=tiny", "trainer.precision=bf16-mixed"],
    ["model=tiny", "trainer.precision=fp32", "model.lora.enabled=true"],
    ["model=tiny", "trainer.precision=bf16-mixed", "model.lora.enabled=true"],
    ["model=smollm2_135m", "trainer.precision=fp32", "model.lora.enabled=true"],
], ids=["tiny-fp32-full", "tiny-bf16-full", "tiny-fp32-lora", "tiny-bf16-lora", "smollm2-fp32-lora"])
def test_the_plan_is_within_15_percent_of_the_measured_cpu_step(compose, tmp_path, settings) -> None:
    cfg = compose([*settings, *SHORT, f"trainer.output_dir={tmp_path / 'run'}"])
    measured, width, trainer = measured_step(cfg, tmp_path / "run")
    assert trainer.precision.weights_dtype in DTYPES
    plan = plan_step(cfg, trainer.tokenizer, trainer.precision, prompt_tokens=width, count_flops=False)
    assert abs(plan.peak - measured) <= 0.15 * measured, (plan.peaks, measured)
    # The parts held through the step are the trainer's own, byte for byte.
    assert plan.optimizer == sum(t.nbytes for s in trainer.updater.optimizer.state.values() for t in s.values())


# CUDA's compute defaults set on the CPU, at responses longer than an LM-head chunk: the decode keeps the head's
# inputs, every pass takes the head in chunks (whole [B, T, V] logits would be 4x the chunks here).
GPU_LIKE = ["trainer.gradient_checkpointing=false", "trainer.chunked_logprobs=true", "trainer.lm_head_chunk=32",
            "trainer.max_tokens_per_micro_batch=1024", "trainer.max_new_tokens=48", "algorithm.group_size=4",
            "trainer.prompts_per_step=2", "trainer.eval_prompts=0", "trainer.progress_bar=false",
            "trainer.num_threads=1", "trainer.steps=2", "reward=length"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_plan_of_chunked_passes_is_the_measured_step(compose, tmp_path, precision) -> None:
    cfg = compose(["model=tiny", f"trainer.precision={precision}", *GPU_LIKE, f"trainer.output_dir={tmp_path / 'run'}"])
    measured, width, trainer = measured_step(cfg, tmp_path / "run")
    plan = plan_step(cfg, trainer.tokenizer, trainer.precision, prompt_tokens=width, count_flops=False)
    assert abs(plan.peak - measured) <= 0.05 * measured, (plan.peaks, measured)


def test_plan_prints_a_table_and_a_json_line(run_cli) -> None:
    code, out, err = run_cli(["plan", "model=tiny", *SHORT[:3], "data.max_prompt_tokens=16", "--device", "cuda",
                              "--device-memory", "1", "--peak-tflops", "100", "--step-seconds", "0.5"])
    assert code == 0, err
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary["phases"]) == {"weights", "reference", "optimizer", "kv_cache", "generation", "scoring",
                                      "training", "engine_reservation"}
    assert summary["fits"] is True and summary["device_memory_gib"] == 1.0
    assert summary["peak_gib"] == max(summary["phases"][k] for k in ("generation", "scoring", "training"))
    # 4 rows x 20 tokens; the tiny model's weights: 3,219,776 parameters in fp32 (bf16-mixed on a GPU keeps fp32)
    assert summary["rows_per_rank"] == 4 and summary["sequence_tokens"] == 20
    assert summary["phases"]["weights"] == round(3_219_776 * 4 / (1 << 30), 3)
    assert summary["mfu"] == pytest.approx(summary["flops_per_step"] / (0.5 * 100e12))
    assert any(line.startswith("peak") for line in lines)
    # What it was planned with: this environment's versions and the attention code the plan's model ran.
    assert summary["versions"] == {"torch": version("torch"), "transformers": version("transformers"),
                                   "peft": version("peft"), "attention": "sdpa", "device": device_name("cuda")}
    assert lines[-2] == (f"planned with torch {version('torch')}, transformers {version('transformers')}, sdpa "
                         f"attention, for {device_name('cuda')}")
    code, out, _ = run_cli(["plan", "model=tiny", *SHORT[:3], "--device", "cuda", "--device-memory", "0.01"])
    assert json.loads(out.strip().splitlines()[-1])["fits"] is False


def test_a_plan_for_a_run_of_other_versions_is_one_line(run_cli, tmp_path) -> None:
    """``--versions`` (a run's versions.json): other torch or transformers are refused before the plan's seconds,
    other attention code after it; the same versions plan; a damaged file is one line."""
    here = {"torch": version("torch"), "transformers": version("transformers"), "device": "NVIDIA H200"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**here, "transformers": "5.17.0"}))
    code, out, err = run_cli(["plan", "model=tiny", *SHORT[:3], "--versions", str(other)])
    assert (code, out) == (2, "") and err == (
        f"error: a plan for the versions of {other} cannot be made here: transformers {version('transformers')} "
        "here, 5.17.0 there (a plan runs the installed code); plan where those versions are installed (make "
        "gpu-bundle carries the pinned ones), or leave out --versions\n")
    eager = tmp_path / "eager.json"
    eager.write_text(json.dumps({**here, "attention": "eager"}))
    code, _, err = run_cli(["plan", "model=tiny", *SHORT[:3], "data.max_prompt_tokens=16", "--versions", str(eager)])
    assert code == 2 and err.endswith("cannot be made here: attention sdpa here, eager there (a plan runs the installed "
                                      "code); plan where those versions are installed (make gpu-bundle carries the "
                                      "pinned ones), or leave out --versions\n")
    same = tmp_path / "same.json"
    same.write_text(json.dumps({**here, "attention": "sdpa", "cuda": "12.8"}))  # the device is the plan's own
    code, out, err = run_cli(["plan", "model=tiny", *SHORT[:3], "data.max_prompt_tokens=16", "--versions", str(same)])
    assert code == 0, err
    for text, reason in [("{not json", "cannot read it as JSON (JSONDecodeError)"),
                         ("[1, 2]", "not a versions file (a JSON object naming at least one of torch, transformers, "
                                    "attention, as benchmarks/gpu_check.sh writes)")]:
        other.write_text(text)
        assert run_cli(["plan", "model=tiny", "--versions", str(other)]) == (2, "", f"error: --versions {other}: {reason}\n")
    missing = tmp_path / "missing.json"
    assert run_cli(["plan", "model=tiny", "--versions", str(missing)]) == (
        2, "", f"error: --versions {missing}: cannot read it as JSON (No such file or directory)\n")


def test_fsdp_ranks_hold_a_share_of_the_states(run_cli) -> None:
    """The 4-rank plan as its own ``rlhf-lab plan`` process: its fake process group must be the process's default
    group, which an in-process vLLM engine of an earlier test in the same worker may hold for good."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    base = ["plan", "model=tiny", "trainer.prompts_per_step=4", "algorithm.group_size=2", "trainer.max_new_tokens=4",
            "data.max_prompt_tokens=16", "--device", "cuda"]
    one = json.loads(run_cli(base)[1].strip().splitlines()[-1])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "rlhf_lab", *base, "trainer.strategy=fsdp", "--world-size", "4"],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    four = json.loads(done.stdout.strip().splitlines()[-1])
    assert four["rows_per_rank"] == 2 and one["rows_per_rank"] == 8
    # FSDP2 over a fake group of 4 ranks: each holds a quarter of the weights and of AdamW's state
    assert four["phases"]["weights"] == pytest.approx(one["phases"]["weights"] / 4, abs=0.001)
    assert four["phases"]["optimizer"] == pytest.approx(one["phases"]["optimizer"] / 4, abs=0.001)
    assert four["peak_gib"] < one["peak_gib"]


def test_an_fsdp_plan_in_a_process_with_a_process_group_is_one_line(tmp_path) -> None:
    """The plan's fake process group must be the process's default one: where a group exists (here a gloo group of
    one rank, in a process of its own), one line names it instead of torch's "initialize twice" error."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "from rlhf_lab.errors import ToolError\n"
        "from rlhf_lab.tools.plan import make_plan\n"
        "try:\n"
        "    make_plan(['model=tiny', 'trainer.strategy=fsdp', 'trainer.max_new_tokens=2'], 'cuda', 4, 80.0)\n"
        "except ToolError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ("an FSDP plan (--world-size 4) needs a process without a process group; this one "
                                   "has one (1 ranks): run `rlhf-lab plan` in a process of its own")


@pytest.mark.parametrize("overrides, message", [
    (["model=tny"], "model='tny' is not an option"),
    (["trainer.lr=fast"], "trainer.lr"),
])
def test_a_config_that_does_not_compose_is_one_line(run_cli, overrides, message) -> None:
    code, out, err = run_cli(["plan", *overrides])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--prompt-tokens", "-5"], "--prompt-tokens -5: must be a positive number"),
    (["--prompt-tokens", "0"], "--prompt-tokens 0: must be a positive number"),
    (["--device-memory", "-1"], "--device-memory -1.0: must be a positive number"),
    (["--step-seconds", "0"], "--step-seconds 0.0: must be a positive number"),
    (["--peak-tflops", "nan"], "--peak-tflops nan: must be a positive number"),
    (["--world-size", "0"], "--world-size 0: must be a positive number"),
])
def test_a_flag_that_is_not_a_positive_number_is_one_line(run_cli, flags, message) -> None:
    assert run_cli(["plan", "model=tiny", *flags]) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize("config", [
    {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 100},
    {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100},
], ids=["seq2seq", "encoder"])
def test_a_config_json_that_is_not_a_causal_lm_is_one_line(run_cli, tmp_path, tiny_tokenizer, config) -> None:
    tiny_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    code, _, err = run_cli(["plan", "model=path", f"model.name_or_path={tmp_path}"])
    assert code == 2 and "is not a causal language model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("architecture", "bad", "expected"), [
    ("llama", {"num_attention_heads": 0}, "num_attention_heads=0"),  # Llama's config divides by it as it is built
    ("qwen2", {"hidden_size": -64}, "hidden_size=-64"),
    ("qwen2", {"num_hidden_layers": 1.5}, "num_hidden_layers=1.5"),
    ("qwen2", {"num_key_value_heads": 0}, "num_key_value_heads=0"),
])
def test_a_config_json_with_impossible_shapes_is_one_line(run_cli, tmp_path, tiny_tokenizer, architecture, bad,
                                                          expected) -> None:
    tiny_tokenizer.save_pretrained(tmp_path)
    name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[architecture]
    config = {"model_type": architecture, "architectures": [name], "vocab_size": 1000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              **bad}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    code, out, err = run_cli(["plan", "model=path", f"model.name_or_path={tmp_path}", "--device", "cpu"])
    assert (code, out) == (2, "") and err.startswith(f"error: model.name_or_path={str(tmp_path)!r}: its config.json "
                                                     f"has {expected}") and err.count("\n") == 1, err


def test_a_model_given_by_its_config_json_alone_is_planned(run_cli, tmp_path, tiny_tokenizer) -> None:
    from transformers import Qwen2Config

    tiny_tokenizer.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    code, out, err = run_cli(["plan", "model=path", f"model.name_or_path={tmp_path}", *SHORT[:3],
                              "data.max_prompt_tokens=8", "--device", "cpu", "trainer.precision=fp32"])
    assert code == 0, err
    parameters = 1000 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 2 * 32 + 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert json.loads(out.strip().splitlines()[-1])["phases"]["weights"] == round(parameters * 4 / (1 << 30), 3)
    assert torch.get_default_dtype() == torch.float32


def test_the_trainers_memory_check_refuses_a_run_whose_planned_peak_does_not_fit(compose, tmp_path, monkeypatch,
                                                                                tiny_tokenizer) -> None:
    """Close to the memory available the planned step decides, not the per-token estimate (which counts logits at
    every prompt token too): a run 1% short of its planned peak is refused, one 1% above it starts."""
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.training import memory_check

    cfg = compose(["model=tiny", "trainer.precision=fp32", *SHORT, f"trainer.output_dir={tmp_path / 'run'}"])
    floor = memory_check.check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu")).total
    plan = plan_step(cfg, tiny_tokenizer, Precision("fp32", "cpu"), count_flops=False)
    assert plan.peak < floor < memory_check.PLAN_WITHIN * plan.peak
    monkeypatch.setattr(memory_check, "available_memory", lambda device: int(plan.peak * 0.99))
    with pytest.raises(memory_check.ConfigError) as refused:
        Trainer(cfg, tmp_path / "run")
    message = str(refused.value)
    assert message.startswith(f"this run needs about {plan.peak / (1 << 30):.3g} GiB")  # the message's 3 figures
    assert f"GiB at its {plan.peak_phase} peak (planned: weights 0.012, reference 0.012, optimizer 0.024" in message
    assert message.endswith("or set trainer.skip_memory_check=true to start anyway") and "\n" not in message
    monkeypatch.setattr(memory_check, "available_memory", lambda device: int(plan.peak * 1.01))
    Trainer(cfg, tmp_path / "run2")  # fits, though the estimate alone would have refused it


def test_a_cuda_precision_is_planned_with_the_autocast_of_the_cpu_tensors_it_runs_on(compose, tiny_tokenizer) -> None:
    """The plan's step runs on CPU tensors: handed a CUDA run's precision (whose autocast would leave CPU tensors in
    float32) it plans the same bf16-mixed step as for the CPU one."""
    from rlhf_lab.runtime.precision import Precision

    chosen = [*SHORT, *CPU_DEFAULTS]  # the compute options both devices would otherwise choose apart
    cfg = compose(["model=tiny", "trainer.precision=bf16-mixed", *chosen])
    on_cpu = plan_step(cfg, tiny_tokenizer, Precision("bf16-mixed", "cpu"), prompt_tokens=16, count_flops=False)
    on_cuda = plan_step(cfg, tiny_tokenizer, Precision("bf16-mixed", "cuda"), prompt_tokens=16, count_flops=False)
    fp32 = plan_step(compose(["model=tiny", "trainer.precision=fp32", *chosen]), tiny_tokenizer,
                     Precision("fp32", "cpu"), prompt_tokens=16, count_flops=False)
    assert on_cuda.peaks == on_cpu.peaks and on_cuda.peaks != fp32.peaks


CPU_DEFAULTS = ["trainer.gradient_checkpointing=false", "trainer.chunked_logprobs=false",
                "trainer.max_tokens_per_micro_batch=0"]


def test_the_plan_command_plans_cuda_s_defaults(run_cli) -> None:
    """``rlhf-lab plan --device cuda``: the step a CUDA run takes with its null compute options."""
    from rlhf_lab.step.compute import GPU_TOKEN_BUDGET

    base = ["plan", "model=tiny", *SHORT[:3], "trainer.precision=bf16-mixed", "--device", "cuda"]
    plans = []
    for extra in ([], ["trainer.gradient_checkpointing=true", "trainer.chunked_logprobs=true",
                       f"trainer.max_tokens_per_micro_batch={GPU_TOKEN_BUDGET}"], CPU_DEFAULTS):
        code, out, err = run_cli([*base, *extra])
        assert code == 0, err
        plans.append(json.loads(out.strip().splitlines()[-1]))
    assert plans[0] == plans[1] and plans[0]["flops_per_step"] != plans[2]["flops_per_step"]
    # LoRA under those defaults: the exact KL of whole logits sliced from the unshared pass (fake tensors).
    code, out, err = run_cli([*base, "model.lora.enabled=true", "model.lora.r=4"])
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["fits"] is True, err


def test_a_device_s_defaults_are_planned_as_its_run_takes_them(compose, tiny_tokenizer) -> None:
    """The planned step runs on CPU tensors, but a CUDA run's null compute options are CUDA's (gradient
    checkpointing, chunked log-probs, a 16k-token budget): the plan of the defaults is the plan of those set."""
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.step.compute import GPU_TOKEN_BUDGET

    cuda = Precision("bf16-mixed", "cuda")
    shape = [*SHORT, "model.tiny.num_hidden_layers=2", "trainer.precision=bf16-mixed"]
    defaults = plan_step(compose(["model=tiny", *shape]), tiny_tokenizer, cuda, prompt_tokens=16)
    set_ = plan_step(compose(["model=tiny", *shape, "trainer.gradient_checkpointing=true",
                              "trainer.chunked_logprobs=true", f"trainer.max_tokens_per_micro_batch={GPU_TOKEN_BUDGET}"]),
                     tiny_tokenizer, cuda, prompt_tokens=16)
    cpu = plan_step(compose(["model=tiny", *shape]), tiny_tokenizer, Precision("bf16-mixed", "cpu"), prompt_tokens=16)
    cpu_set = plan_step(compose(["model=tiny", *shape, *CPU_DEFAULTS]), tiny_tokenizer, cuda, prompt_tokens=16)
    assert defaults.peaks == set_.peaks and defaults.flops == set_.flops
    assert cpu.peaks == cpu_set.peaks and cpu.flops == cpu_set.flops
    assert defaults.flops != cpu.flops  # the layers recomputed in the backward


def test_counting_flops_leaves_the_planned_memory_as_it_is(compose, tiny_tokenizer, monkeypatch) -> None:
    """Under gradient checkpointing torch's FLOP counter's module tracker kept each micro-batch's recomputed layers
    alive: the planned training peak grew with the batch. The step's counter counts the same FLOPs, globally."""
    from torch.utils.flop_counter import FlopCounterMode

    from rlhf_lab.planner import step as planner_step
    from rlhf_lab.runtime.precision import Precision

    precision = Precision("bf16-mixed", "cpu")
    base = ["model=tiny", *SHORT, "trainer.precision=bf16-mixed", "trainer.max_new_tokens=64",
            "trainer.gradient_checkpointing=true", "trainer.chunked_logprobs=true",
            "trainer.max_tokens_per_micro_batch=256", "data.max_prompt_tokens=64"]
    peaks = {}
    for groups in (2, 4):
        cfg = compose([*base, f"trainer.prompts_per_step={groups}"])
        counted = plan_step(cfg, tiny_tokenizer, precision, prompt_tokens=64)
        uncounted = plan_step(cfg, tiny_tokenizer, precision, prompt_tokens=64, count_flops=False)
        assert counted.peaks == uncounted.peaks
        peaks[groups] = counted.peaks["training"]
    assert abs(peaks[4] - peaks[2]) <= 0.02 * peaks[2]  # micro-batches of the same size: the same peak
    monkeypatch.setattr(planner_step, "StepFlops", lambda: FlopCounterMode(display=False))
    torch_counted = plan_step(cfg, tiny_tokenizer, precision, prompt_tokens=64)
    assert torch_counted.flops == counted.flops


def test_the_synthetic_prompts_are_left_padded_as_a_real_batch_is() -> None:
    """The widest at the plan's prompt width, the others shorter down to half of it (a real batch's prompts differ
    in length: its rows run with padding and an attention mask), every prompt distinct."""
    prompts = synthetic_prompts(4, 16, 100)
    assert [len(p) for p in prompts] == [16, 14, 11, 8]  # 16 − ⌊8·i/3⌋
    assert len({tuple(p) for p in prompts}) == 4 and all(0 <= t < 100 for p in prompts for t in p)
    assert [len(p) for p in synthetic_prompts(1, 16, 100)] == [16]


def test_a_config_json_alone_is_planned_from_its_shapes(run_cli, tmp_path, tiny_tokenizer) -> None:
    """No tokenizer beside config.json: the shapes stand in for it (one note line says so) and the plan is the one
    the same folder gets with a tokenizer."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=7)
    shapes, full = tmp_path / "shapes", tmp_path / "full"
    config.save_pretrained(shapes)
    config.save_pretrained(full)
    tiny_tokenizer.save_pretrained(full)
    flags = [*SHORT[:3], "data.max_prompt_tokens=8", "--prompt-tokens", "8", "--device", "cpu", "trainer.precision=fp32"]
    code, out, err = run_cli(["plan", "model=path", f"model.name_or_path={shapes}", *flags])
    assert code == 0, err
    assert err == (f"plan: no tokenizer in {shapes} (it holds no tokenizer file); planned from config.json's shapes: "
                   "a vocabulary of 1000, pad id 7\n")
    code, with_tokenizer, err = run_cli(["plan", "model=path", f"model.name_or_path={full}", *flags])
    assert code == 0 and err == "", err
    planned = [json.loads(text.strip().splitlines()[-1]) for text in (out, with_tokenizer)]
    assert planned[0]["phases"] == planned[1]["phases"] and planned[0]["peak_gib"] == planned[1]["peak_gib"]


def test_the_plan_takes_the_prompt_length_from_the_data(run_cli, tmp_path, tiny_tokenizer) -> None:
    """Without --prompt-tokens the plan reads the run's prompts and plans its longest (counted here with the
    tokenizer, no chat template), within data.max_prompt_tokens; a note line says which."""
    prompts = ["hello", "the sea is wide and the sky is grey above the long quiet shore"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    longest = max(len(tiny_tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    common = ["plan", "model=tiny", "model.chat_template=false", "data=jsonl", f"data.path={data}", *SHORT[:3],
              "--device", "cpu"]
    for limit, expected in ((64, longest), (5, 5)):
        code, out, err = run_cli([*common, f"data.max_prompt_tokens={limit}"])
        assert code == 0, err
        assert err.splitlines()[-1] == (f"plan: prompts of {expected} tokens, the longest of the data's 2 (data."
                                        f"max_prompt_tokens={limit} admits up to it; --prompt-tokens plans another)")
        line = json.loads(out.strip().splitlines()[-1])
        assert line["sequence_tokens"] == expected + 4


def test_a_plan_that_does_not_fit_plans_each_change_that_would_make_it(run_cli) -> None:
    """The tiny run in 0.08 GiB does not fit: each change the plan page lists is planned on its own and printed with
    its peak (LoRA and FSDP over 8 ranks fit here); each equals the plan of the run with that change; --no-advice
    prints none."""
    run = ["plan", "model=tiny", *SHORT[:3], "data.max_prompt_tokens=16", "--prompt-tokens", "16", "--device", "cpu",
           "--device-memory", "0.08"]
    code, out, err = run_cli(run)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["fits"] is False
    advice = {entry["change"]: entry for entry in summary["advice"]}
    assert list(advice) == ["model.lora.enabled=true", "trainer.offload_reference=true",
                            "trainer.gradient_checkpointing=true", "trainer.micro_batch_size=1",
                            "trainer.max_new_tokens=2", "trainer.strategy=fsdp --world-size 8"]
    assert advice["model.lora.enabled=true"]["fits"] and advice["trainer.strategy=fsdp --world-size 8"]["fits"]
    lines = out.splitlines()
    start = lines.index("what would make it fit, each change planned on its own:")
    assert [line.split()[0] for line in lines[start + 1:start + 7]] == [change.split()[0] for change in advice]
    for change in ("model.lora.enabled=true", "trainer.max_new_tokens=2"):
        code, alone, err = run_cli([*run, change, "--no-advice"])
        assert code == 0, err
        alone_summary = json.loads(alone.strip().splitlines()[-1])
        assert alone_summary["peak_gib"] == advice[change]["peak_gib"] and "advice" not in alone_summary


def test_a_run_whose_held_state_alone_is_over_the_memory_is_refused_without_a_plan(compose, tmp_path, monkeypatch,
                                                                                  tiny_tokenizer) -> None:
    """Weights, gradients, AdamW's moments and the reference are held at the training peak whatever the batch: where
    they alone are over the memory available, the check refuses at once (the plan, which can take minutes for a large
    model, never runs); the same run with the memory just over them is planned."""
    from rlhf_lab.runtime.precision import Precision
    from rlhf_lab.training import memory_check

    cfg = compose(["model=tiny", "trainer.precision=fp32", *SHORT, f"trainer.output_dir={tmp_path / 'run'}"])
    estimate = memory_check.check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"))
    held = estimate.total - estimate.activations
    assert held == estimate.weights + estimate.gradients + estimate.optimizer + estimate.reference > 0
    plans: list[int] = []
    monkeypatch.setattr(memory_check, "check_plan", lambda *args: plans.append(args[-1]))
    monkeypatch.setattr(memory_check, "available_memory", lambda device: held - 1)
    with pytest.raises(memory_check.ConfigError, match=r"^this run needs about .* GiB \(weights .*\), this machine has"):
        memory_check.check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"),
                                  precision=Precision("fp32", "cpu"))
    assert plans == []
    monkeypatch.setattr(memory_check, "available_memory", lambda device: held + 1)
    memory_check.check_memory(cfg, tiny_tokenizer, torch.float32, None, torch.device("cpu"),
                              precision=Precision("fp32", "cpu"))
    assert plans == [held + 1]
