"""Numerical guards, non-finite rewards, crash-safe checkpoints and safe loading.

Everything here runs in-process on the tiny random Llama (or a smaller one built here), so it takes
seconds: the command-line side of the same guarantees is in ``test_bad_inputs.py`` and ``test_resume.py``.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import rlhf_lab
from rlhf_lab.algorithms.base import LossContext
from rlhf_lab.data.prompts import prompt_indices
from rlhf_lab.rewards.base import RewardError, fill_nonfinite
from rlhf_lab.training import checkpoint as ckpt
from rlhf_lab.training.loop import Trainer, TrainingStopped

REWARDS_MODULE = "reliability_rewards"
REWARDS_SOURCE = '''
def nan_for_first(prompts, responses):
    """NaN for sample 0, the response length for the others."""
    return [float("nan")] + [float(len(r)) for r in responses[1:]]
'''


@pytest.fixture
def rewards_module(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = tmp_path_factory.getbasetemp() / "reliability_rewards_module"
    folder.mkdir(exist_ok=True)
    (folder / f"{REWARDS_MODULE}.py").write_text(textwrap.dedent(REWARDS_SOURCE))
    monkeypatch.syspath_prepend(str(folder))
    return REWARDS_MODULE


def make_trainer(compose, tiny_overrides, run_dir: Path, *overrides: str) -> Trainer:
    cfg = compose([*tiny_overrides(None), "trainer.eval_prompts=0", *overrides])
    return Trainer(cfg, run_dir)


# ------------------------------------------------------------------------------ non-finite rewards


def test_fill_nonfinite_keeps_each_group_mean() -> None:
    scores = torch.tensor([1.0, float("nan"), 3.0, float("inf"), float("nan"), float("-inf")])
    filled, valid = fill_nonfinite(scores, group_size=3)
    assert valid.tolist() == [True, False, True, False, False, False]
    # Group 0 keeps its mean (2.0); group 1 has no finite score and takes the batch mean of finite ones.
    assert filled.tolist() == [1.0, 2.0, 3.0, 2.0, 2.0, 2.0]


def test_nan_reward_with_error_names_the_sample_and_prompt(compose, tiny_overrides, tmp_path, rewards_module):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "reward=python",
                           f"reward.function={rewards_module}:nan_for_first", "reward.on_nonfinite=error")
    first_prompt = prompt_indices(0, 2, len(trainer.prompts.train), seed=0)[0]
    expected = (f"reward 'python' ({rewards_module}:nan_for_first) returned nan for sample 0 "
                f"(train prompt {first_prompt}); reward.on_nonfinite=drop drops such samples instead")
    with pytest.raises(RewardError) as raised:
        trainer.train_step(0)
    assert str(raised.value) == expected


def test_nan_from_a_composite_component_names_the_component(compose, tiny_overrides, tmp_path, rewards_module):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "reward=composite",
                           f"reward.components=[{{name:python,key:custom,function:'{rewards_module}:nan_for_first'}},"
                           "{name:length}]")
    first_prompt = prompt_indices(0, 2, len(trainer.prompts.train), seed=0)[0]
    with pytest.raises(RewardError) as raised:
        trainer.train_step(0)
    assert str(raised.value) == (
        f"component 'custom' of reward 'composite' returned nan for sample 0 (train prompt {first_prompt}); "
        "reward.on_nonfinite=drop drops such samples instead"
    )


def test_nan_reward_with_drop_contributes_nothing(compose, tiny_overrides, tmp_path, rewards_module):
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "reward=python",
                           f"reward.function={rewards_module}:nan_for_first", "reward.on_nonfinite=drop")
    seen = {}
    update = trainer.updater.update

    def spy(rollout, coef, step, timer):
        seen["rollout"] = rollout
        return update(rollout, coef, step, timer)

    trainer.updater.update = spy
    metrics = trainer.train_step(0)
    rollout = seen["rollout"]

    assert metrics["reward/dropped"] == 1
    assert metrics["optim/skipped"] == 0.0
    assert metrics["reward/mean"] == pytest.approx(rollout.scores[1:].mean().item())  # the finite ones only
    # Sample 0 took its group's mean (sample 1's score), so that group's mean is unchanged ...
    assert rollout.scores[0] == rollout.scores[1]
    # ... and from then on it has no tokens, no advantage, and weighs nothing in the loss.
    assert rollout.response_mask[0].sum() == 0
    assert (rollout.response_mask[1:].sum(-1) > 0).all()
    assert torch.all(rollout.advantages[0] == 0)

    context = LossContext(float(rollout.response_mask.sum()), 3)
    coef = trainer.kl_controller.coef
    loss = trainer.updater.micro_loss(rollout, context, coef).loss
    perturbed = rollout.select(torch.arange(rollout.batch_size))
    width = perturbed.prompt_width
    perturbed.input_ids[0, width:] = torch.randint(3, 1000, perturbed.input_ids[0, width:].shape)
    perturbed.logprobs[0] = torch.randn_like(perturbed.logprobs[0])
    perturbed.ref_logprobs[0] = torch.randn_like(perturbed.ref_logprobs[0])
    perturbed_loss = trainer.updater.micro_loss(perturbed, context, coef).loss
    assert torch.equal(loss, perturbed_loss)


# ------------------------------------------------------------------------------ non-finite loss / gradient


def test_a_kl_coefficient_that_overflows_every_update_stops_naming_it(compose, tiny_overrides, tmp_path):
    """kl.coef=1e300 (a warning at compose: it may be a deliberate control) trains step 0, where the policy is the
    reference and the KL exactly 0; once the policy moves the KL term overflows, every update is skipped, and the
    stop says why."""
    run_dir = tmp_path / "run"
    with pytest.warns(UserWarning, match="kl.coef=1e"):
        trainer = make_trainer(compose, tiny_overrides, run_dir, "trainer.steps=4", "kl.coef=1e300",
                               "trainer.max_consecutive_skips=2", "trainer.save=none")
    with pytest.raises(TrainingStopped) as raised:
        trainer.train()
    assert "2 consecutive updates were skipped for non-finite loss or gradient (kl.coef=1e+300 scales the KL term " \
           "past what the loss's float holds once the policy leaves the reference: lower kl.coef)" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_nonfinite_loss_and_gradient_skip_updates_then_stop_with_last_good_checkpoint(
    compose, tiny_overrides, tmp_path
):
    run_dir = tmp_path / "run"
    trainer = make_trainer(compose, tiny_overrides, run_dir, "trainer.steps=6", "trainer.checkpoint_every=1",
                           "trainer.keep_last_n=10", "trainer.max_consecutive_skips=2", "trainer.lr=1e-2")
    loss_fn = trainer.algorithm.loss

    def loss_nan_at_step_1(batch, output, context):
        result = loss_fn(batch, output, context)
        if trainer.step == 1:
            result.loss = result.loss * float("nan")
        return result

    trainer.algorithm.loss = loss_nan_at_step_1
    # Step 2: the loss is finite but one gradient is not.
    weight = next(p for p in trainer.policy.parameters() if p.requires_grad)
    weight.register_hook(lambda grad: grad * float("inf") if trainer.step == 2 else grad)

    with pytest.raises(TrainingStopped) as raised:
        trainer.train()
    stop = raised.value
    assert stop.exit_code == 3
    assert str(stop) == (
        "stopped after step 2: 2 consecutive updates were skipped for non-finite loss or gradient; "
        f"checkpoint {run_dir / 'checkpoints' / 'step_3'} written; continue with: trainer.resume=auto "
        f"trainer.output_dir={run_dir.resolve()}"
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["optim/skipped"] for line in lines] == [0.0, 1.0, 1.0]

    good, last = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_3"  # after 1 and 3 updates
    good_weights = load_file(str(good / "model" / "model.safetensors"))
    last_weights = load_file(str(last / "model" / "model.safetensors"))
    assert good_weights.keys() == last_weights.keys()
    assert all(torch.equal(good_weights[k], last_weights[k]) for k in good_weights)
    live = trainer.policy.state_dict()
    assert all(torch.equal(live[k], good_weights[k]) for k in good_weights)
    # Adam's moments and step count did not move either.
    good_optimizer = load_file(str(good / ckpt.OPTIMIZER_FILE))
    last_optimizer = load_file(str(last / ckpt.OPTIMIZER_FILE))
    assert all(torch.equal(good_optimizer[k], last_optimizer[k]) for k in good_optimizer)
    assert json.loads((last / ckpt.STATE_FILE).read_text())["consecutive_skips"] == 2


# ------------------------------------------------------------------------------ run folders


def test_a_fresh_run_refuses_a_folder_with_checkpoints_before_loading_anything(compose, tiny_overrides, tmp_path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    run_dir = tmp_path / "run"
    save(run_dir / "checkpoints", 3, tiny_parts())

    def must_not_load(*args, **kwargs):
        raise AssertionError("nothing may load before the run folder is checked")

    monkeypatch.setattr("rlhf_lab.training.loop.load_prompts", must_not_load)
    with pytest.raises(ckpt.CheckpointError) as raised:
        make_trainer(compose, tiny_overrides, run_dir)
    assert str(raised.value) == (
        f"run folder {str(run_dir)!r} already holds checkpoints; continue it with trainer.resume=auto, choose "
        "another trainer.output_dir, or replace it with trainer.overwrite=true"
    )


def test_resuming_a_checkpoint_of_another_model_is_a_one_line_error(compose, tiny_overrides, tmp_path):
    other = tmp_path / "other"
    save(other / "checkpoints", 3, tiny_parts())
    with pytest.raises(ckpt.CheckpointError) as raised:
        make_trainer(compose, tiny_overrides, tmp_path / "run", f"trainer.resume={other}", "trainer.steps=5")
    assert str(raised.value) == (
        f"checkpoint {other / 'checkpoints' / 'step_3'} does not match the configured model: size mismatch for "
        "model.embed_tokens.weight: copying a param with shape torch.Size([32, 8]) from checkpoint, the shape in "
        "current model is torch.Size([49152, 64])."
    )


# ------------------------------------------------------------------------------ checkpoints (unit level)


class FolderTokenizer:
    """Stands in for a tokenizer: ``save_pretrained`` writes one small file."""

    def save_pretrained(self, folder: Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "tokenizer_config.json").write_text("{}")


def tiny_parts(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    policy = LlamaForCausalLM(config)
    head = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW([*policy.parameters(), *head.parameters()], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return policy, {"value_head": head}, optimizer, scheduler


def train_once(policy, modules, optimizer, scheduler) -> None:
    ids = torch.randint(0, 32, (2, 5))
    loss = policy(input_ids=ids, labels=ids).loss + modules["value_head"](torch.randn(2, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def save(root: Path, updates: int, parts, keep_last_n: int = 10) -> Path:
    policy, modules, optimizer, scheduler = parts
    return ckpt.save_checkpoint(root, updates, policy, FolderTokenizer(), modules, optimizer, scheduler,
                                {"kl_controller": {"coef": 0.1}}, keep_last_n=keep_last_n)


@pytest.fixture
def saved(tmp_path: Path):
    """Checkpoints step_3 and step_4 under tmp_path/checkpoints, from one tiny model trained between them."""
    parts = tiny_parts()
    root = tmp_path / "checkpoints"
    for step in (3, 4):
        train_once(*parts)
        save(root, step, parts)
    return root, parts


def test_checkpoint_round_trip_restores_everything_exactly(saved):
    root, parts = saved
    policy, modules, optimizer, scheduler = parts
    expected_params = {k: v.clone() for k, v in policy.state_dict().items()}
    expected_head = {k: v.clone() for k, v in modules["value_head"].state_dict().items()}
    expected_optimizer = optimizer.state_dict()
    expected_scheduler = scheduler.state_dict()
    expected_random = torch.rand(3)

    fresh = tiny_parts(seed=1)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(root), fresh[0], fresh[1], fresh[2], fresh[3],
                                 uses_adapter=False)
    assert state == {"step": 3, "kl_controller": {"coef": 0.1}}  # step_4 holds 4 updates: steps 0..3
    assert torch.equal(torch.rand(3), expected_random)  # the torch generator is where it was at the save
    assert all(torch.equal(fresh[0].state_dict()[k], v) for k, v in expected_params.items())
    assert all(torch.equal(fresh[1]["value_head"].state_dict()[k], v) for k, v in expected_head.items())
    got_optimizer = fresh[2].state_dict()
    assert got_optimizer["param_groups"] == expected_optimizer["param_groups"]
    for index, values in expected_optimizer["state"].items():
        assert all(torch.equal(got_optimizer["state"][index][k], v) for k, v in values.items())
    assert fresh[3].state_dict() == expected_scheduler


def test_encoded_state_survives_json(tmp_path: Path):
    value = {0: {"step": torch.tensor(3.0), "betas": (0.9, 0.99)}, "x": [float("inf"), None, True, "s"]}
    tensors: dict[str, torch.Tensor] = {}
    decoded = ckpt.decode_state(json.loads(json.dumps(ckpt.encode_state(value, tensors))), tensors)
    assert decoded[0]["betas"] == (0.9, 0.99) and decoded["x"] == [float("inf"), None, True, "s"]
    assert torch.equal(decoded[0]["step"], torch.tensor(3.0))


def _remove_a_file(folder: Path) -> None:
    (folder / ckpt.OPTIMIZER_FILE).unlink()


def _truncate_weights(folder: Path) -> None:
    weights = folder / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _tear_state_file(folder: Path) -> None:
    state = folder / ckpt.STATE_FILE
    state.write_text(state.read_text()[:40])


def _no_state_file(folder: Path) -> None:
    (folder / ckpt.STATE_FILE).unlink()


@pytest.mark.parametrize("damage", [_remove_a_file, _truncate_weights, _tear_state_file, _no_state_file],
                         ids=["missing_file", "truncated_weights", "torn_state_file", "no_state_file"])
def test_an_incomplete_newest_checkpoint_is_ignored(saved, damage):
    root, parts = saved
    newest = save(root, 5, parts)
    assert ckpt.latest_checkpoint(root) == newest and (root / "latest").read_text() == "step_5"
    damage(newest)
    # `latest` still names step_5, but it is incomplete: the previous complete checkpoint is used.
    assert ckpt.latest_checkpoint(root) == root / "step_4"
    assert ckpt.resolve_resume("auto", root) == root / "step_4"
    assert ckpt.resolve_resume(str(root.parent), root) == root / "step_4"  # a run folder
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.resolve_resume(str(newest), root)
    fresh = tiny_parts(seed=1)
    assert ckpt.load_checkpoint(root / "step_4", *fresh, uses_adapter=False)["step"] == 3


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(saved):
    root, parts = saved
    # What SIGKILL during a save leaves: a temporary folder with some files, `latest` not yet replaced.
    partial = root / ".step_5.k1ll3d"
    shutil.copytree(root / "step_4" / "model", partial / "model")
    assert ckpt.latest_checkpoint(root) == root / "step_4"
    assert ckpt.complete_checkpoints(root) == [root / "step_3", root / "step_4"]
    # `latest` naming a folder that never appeared, or garbage, falls back the same way.
    (root / "latest").write_text("step_9")
    assert ckpt.latest_checkpoint(root) == root / "step_4"
    (root / "latest").write_text("../../etc")
    assert ckpt.latest_checkpoint(root) == root / "step_4"
    # The next save cleans the leftover up.
    save(root, 5, parts)
    assert not partial.exists()
    assert ckpt.latest_checkpoint(root) == root / "step_5"


def test_a_save_that_fails_midway_changes_nothing(saved, monkeypatch: pytest.MonkeyPatch):
    root, parts = saved
    before = sorted(p.name for p in root.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(ckpt.CheckpointError, match=r"^checkpoint at step 5 not written: no space left on .*step 4"):
        save(root, 5, parts)
    assert sorted(p.name for p in root.iterdir()) == before
    assert ckpt.latest_checkpoint(root) == root / "step_4"


def test_keep_last_n_keeps_the_newest(tmp_path: Path):
    parts = tiny_parts()
    root = tmp_path / "checkpoints"
    for step in range(5):
        save(root, step, parts, keep_last_n=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3", "step_4"]
    assert (root / "latest").read_text() == "step_4"


def test_a_checkpoint_of_another_shape_or_kind_is_refused_with_one_line(saved):
    root, _ = saved
    other = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    policy, modules, optimizer, scheduler = tiny_parts(seed=1)
    with pytest.raises(ckpt.CheckpointError, match="does not match the configured model") as raised:
        ckpt.load_checkpoint(root / "step_4", other, modules, optimizer, scheduler, uses_adapter=False)
    assert "\n" not in str(raised.value)
    with pytest.raises(ckpt.CheckpointError, match=r"has no critic \(it was written by another algorithm\)"):
        ckpt.load_checkpoint(root / "step_4", policy, {"critic": torch.nn.Linear(8, 1)}, optimizer, scheduler,
                             uses_adapter=False)
    with pytest.raises(ckpt.CheckpointError, match="holds full weights but model.lora.enabled is not false"):
        ckpt.load_checkpoint(root / "step_4", policy, modules, optimizer, scheduler, uses_adapter=True)


# ------------------------------------------------------------------------------ safe loading


def _torch_load_calls(source: str) -> list[ast.Call]:
    return [
        node for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
    ]


def test_torch_load_is_only_called_with_weights_only_and_nothing_unpickles():
    package = Path(rlhf_lab.__file__).parent
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for call in _torch_load_calls(source):
            keywords = {k.arg: k.value for k in call.keywords}
            assert "weights_only" in keywords, f"{path}:{call.lineno} calls torch.load without weights_only"
            value = keywords["weights_only"]
            assert isinstance(value, ast.Constant) and value.value is True, f"{path}:{call.lineno}"
        tree = ast.parse(source)
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                    for alias in node.names} | {node.module for node in ast.walk(tree)
                                                if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"pickle", "cPickle", "dill", "joblib"}, f"{path} imports a pickle module"


def test_loading_a_checkpoint_unpickles_nothing_and_imports_nothing(saved, monkeypatch: pytest.MonkeyPatch):
    import importlib
    import pickle

    root, _ = saved
    folder = ckpt.latest_checkpoint(root)
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert all(name.endswith((".safetensors", ".json")) for name in files), files

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint load must not unpickle or import anything")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(importlib, "import_module", forbidden)
    state = ckpt.load_checkpoint(folder, *tiny_parts(seed=1), uses_adapter=False)
    assert state["step"] == 3
    assert not any(isinstance(v, str) and ":" in v for v in state.values())  # no `module:function` in it


def test_the_trainer_state_holds_no_code_reference(compose, tiny_overrides, tmp_path, rewards_module):
    """A python reward's ``module:function`` comes from the config only; checkpoints never record it."""
    trainer = make_trainer(compose, tiny_overrides, tmp_path / "run", "reward=python",
                           f"reward.function={rewards_module}:nan_for_first", "reward.on_nonfinite=drop")
    folder = trainer.save(1)
    text = (folder / ckpt.STATE_FILE).read_text()
    assert rewards_module not in text and "function" not in text
    assert math.isfinite(json.loads(text)["kl_controller"]["coef"])
