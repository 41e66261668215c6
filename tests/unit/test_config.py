"""Config schemas, validation and composition (``rlhf_lab.config``), composed as the CLI does it.

Each option of a config group has its own structured schema, so a key of another option is an error that
names the option; choices come from the registry; experiments select with or without ``+``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rlhf_lab import registry
from rlhf_lab.config import CONF_DIR, ConfigError, compose, register_configs
from rlhf_lab.config.compose import group_options
from rlhf_lab.config.schema import (
    ClassifierRewardConfig,
    CompositeRewardConfig,
    DataConfig,
    DataPathConfig,
    ExactModelConfig,
    ExactTableRewardConfig,
    GRPOConfig,
    KLConfig,
    LengthRewardConfig,
    LoggerConfig,
    MathVerifyRewardConfig,
    ModelConfig,
    PairwiseRewardConfig,
    PPOConfig,
    PythonRewardConfig,
    ReasoningGymDataConfig,
    ReasoningGymRewardConfig,
    ReinforceConfig,
    RewardModelConfig,
    RouteRewardConfig,
    SentimentRewardConfig,
    TinyModelConfig,
    WandbLoggerConfig,
)
from rlhf_lab.config.schema_env import (
    CalculatorEnvConfig,
    EnvConfig,
    ExactTwoTurnEnvConfig,
    GuessNumberEnvConfig,
    VerifiersEnvConfig,
)
from rlhf_lab.config.schema_offline import (
    DemonstrationDataConfig,
    DPOConfig,
    EmbeddedPreferenceConfig,
    PreferenceDataConfig,
    RewardModelTrainingConfig,
    SFTConfig,
)

SCHEMAS = {
    "algorithm": {"grpo": GRPOConfig, "dr_grpo": GRPOConfig, "dapo": GRPOConfig, "gspo": GRPOConfig,
                  "cispo": GRPOConfig, "ppo": PPOConfig, "reinforce": ReinforceConfig, "rloo": ReinforceConfig,
                  "reinforce_pp": ReinforceConfig, "remax": ReinforceConfig, "sft": SFTConfig, "dpo": DPOConfig,
                  "reward_model": RewardModelTrainingConfig},
    "kl": {name: KLConfig for name in ("kl", "abs", "mse", "k3", "full", "none", "k1_plus", "k3_plus", "sequence_k1",
                                       "sequence_full")},
    "reward": {
        "sentiment": SentimentRewardConfig,
        "classifier": ClassifierRewardConfig,
        "reward_model": RewardModelConfig,
        "python": PythonRewardConfig,
        "length": LengthRewardConfig,
        "composite": CompositeRewardConfig,
        "exact_table": ExactTableRewardConfig,
        "math_verify": MathVerifyRewardConfig,
        "reasoning_gym": ReasoningGymRewardConfig,
        "pairwise": PairwiseRewardConfig,
        "route": RouteRewardConfig,
    },
    "model": {"smollm2_135m": ModelConfig, "path": ModelConfig, "tiny": TinyModelConfig, "exact": ExactModelConfig},
    "data": {"movie_prompts": DataConfig, "jsonl": DataPathConfig, "csv": DataPathConfig, "hub": DataPathConfig,
             "local": DataPathConfig, "exact": DataConfig, "preferences": PreferenceDataConfig, "demonstrations": DemonstrationDataConfig,
             "embedded_preferences": EmbeddedPreferenceConfig, "reasoning_gym": ReasoningGymDataConfig},
    "env": {"single_turn": EnvConfig, "guess_number": GuessNumberEnvConfig, "calculator": CalculatorEnvConfig,
            "exact_two_turn": ExactTwoTurnEnvConfig, "verifiers": VerifiersEnvConfig},
    # tensorboard, mlflow and csv share wandb's schema type, so logger=[wandb,csv] merges in any order
    "logger": {"none": LoggerConfig, "wandb": WandbLoggerConfig, "tensorboard": WandbLoggerConfig,
               "mlflow": WandbLoggerConfig, "trackio": WandbLoggerConfig, "csv": WandbLoggerConfig},
}
# Overrides that let an option compose and validate offline (its required fields filled in).
NEEDS = {
    ("reward", "classifier"): ["reward.model_path={folder}"],
    ("reward", "reward_model"): ["reward.model_path={folder}"],
    ("reward", "python"): ["reward.function=tests.reward_fns:count_letter"],
    ("model", "path"): ["model.name_or_path={folder}"],
    ("data", "jsonl"): ["data.path={file}"],
    ("data", "csv"): ["data.path={file}"],
    ("data", "local"): ["data.path={file}"],
    ("data", "hub"): ["data.path=org/name"],
    ("model", "exact"): ["data=exact", "trainer.max_new_tokens=3"],  # the exact task's prompt and a small T
    ("reward", "exact_table"): ["model=exact", "data=exact", "trainer.max_new_tokens=3"],
    # The offline stages and their data go together (rlhf_lab/config/validate_offline.py).
    ("algorithm", "sft"): ["data=demonstrations", "data.path={file}"],
    ("algorithm", "dpo"): ["data=preferences", "data.path={file}"],
    ("algorithm", "reward_model"): ["data=preferences", "data.path={file}"],
    ("data", "preferences"): ["algorithm=dpo", "data.path={file}"],
    ("data", "demonstrations"): ["algorithm=sft", "data.path={file}"],
    ("data", "embedded_preferences"): ["algorithm=dpo"],
    ("env", "exact_two_turn"): ["experiment=exact_two_turn"],
}


def keys(schema: type) -> str:
    return ", ".join(field.name for field in dataclasses.fields(schema))


def compose_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as raised:
        compose(overrides)
    message = str(raised.value)
    assert "\n" not in message
    return message


OPTIONAL = {("logger", "mlflow"): "mlflow", ("logger", "trackio"): "trackio"}  # options that need an optional extra


@pytest.mark.parametrize(("group", "option"), [
    pytest.param(g, o, marks=[pytest.mark.extra(OPTIONAL[g, o])] if (g, o) in OPTIONAL else [])
    for g, options in SCHEMAS.items() for o in options])
def test_each_option_composes_with_its_own_schema(group: str, option: str, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")  # a model folder holds weights (their content is not read here)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # so "tests.reward_fns:..." imports
    extra = [o.format(folder=folder, file=tmp_path / "prompts.jsonl") for o in NEEDS.get((group, option), [])]
    if (group, option) == ("env", "verifiers"):  # its package and env.id are looked for at compose time: given
        from rlhf_lab.envs import verifiers_env

        monkeypatch.setattr(verifiers_env, "_findable", lambda module: True)
        extra = ["env.id=some-env"]
    cfg = compose([f"{group}={option}", *extra])
    assert OmegaConf.get_type(cfg[group]) is SCHEMAS[group][option]
    assert cfg[group].name == option


def test_every_option_yaml_has_a_schema_listed_here() -> None:
    for group, options in SCHEMAS.items():
        assert group_options(group) == sorted(options)


def test_group_options_are_yaml_files_not_stored_schemas() -> None:
    assert (Path(registry.__file__).resolve().parents[1] / "conf").samefile(CONF_DIR)  # the checkout's conf/
    register_configs()
    stored = ConfigStore.instance().list("algorithm")
    assert "grpo_schema.yaml" in stored and "ppo_schema.yaml" in stored
    assert group_options("algorithm") == sorted(SCHEMAS["algorithm"])
    assert {"dapo", "grpo", "ppo", "remax"} <= set(group_options("algorithm"))
    assert group_options("experiment") == ["algo_comparison", "algo_comparison_exact", "async_drop_bias", "async_kl", "exact",
                                           "exact_two_turn", "grpo_kl_scale", "kl_ablation", "kl_ablation_exact",
                                           "kl_placement_bias", "kl_to_go", "mode_collapse", "multi_turn_mask",
                                           "off_policy_kl", "smoke"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["reward=sentiment", "reward.min_words=3"],
         "unknown key 'reward.min_words' for reward=sentiment; valid keys: name, on_nonfinite, rescale, "
         "rescale_threshold, rescale_anchor, target"),
        (["algorithm=ppo", "algorithm.weight_by=reward"],
         f"unknown key 'algorithm.weight_by' for algorithm=ppo; valid keys: {keys(PPOConfig)}"),
        (["algorithm=grpo", "algorithm.critic=separate"],
         f"unknown key 'algorithm.critic' for algorithm=grpo; valid keys: {keys(GRPOConfig)}"),
        (["algorithm=rloo", "algorithm.gamma=0.9"],
         f"unknown key 'algorithm.gamma' for algorithm=rloo; valid keys: {keys(ReinforceConfig)}"),
        (["model=smollm2_135m", "model.tiny.hidden_size=8"],
         f"unknown key 'model.tiny' for model=smollm2_135m; valid keys: {keys(ModelConfig)}"),
        (["logger=none", "logger.project=x"],
         "unknown key 'logger.project' for logger=none; did you mean 'logger.trackio_project'? valid keys: name, "
         "mode, samples_every, trackers, mlflow_tracking_uri, mlflow_experiment, trackio_project"),
        (["data=movie_prompts", "data.path=x"],
         f"unknown key 'data.path' for data=movie_prompts; valid keys: {keys(DataConfig)}"),
        (["experiment=smoke", "model.tiny.depth=3"],
         "unknown key 'model.tiny.depth'; valid keys of model.tiny: hidden_size, num_hidden_layers, "
         "num_attention_heads, num_key_value_heads, intermediate_size"),
    ],
)
def test_a_key_of_another_option_is_an_error_naming_the_option(overrides: list[str], expected: str) -> None:
    assert compose_error(overrides) == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["reward=sentiment", "+reward.min_words=3"],
         "unknown key 'reward.min_words' for reward=sentiment; valid keys: name, on_nonfinite, rescale, "
         "rescale_threshold, rescale_anchor, target"),
        (["algorithm=ppo", "+algorithm.scale_by_std=false"],
         f"unknown key 'algorithm.scale_by_std' for algorithm=ppo; valid keys: {keys(PPOConfig)}"),
        (["model=tiny", "+model.tiny.depth=3"],
         "unknown key 'model.tiny.depth'; valid keys of model.tiny: hidden_size, num_hidden_layers, "
         "num_attention_heads, num_key_value_heads, intermediate_size"),
        (["+trainer.stepz=3"], "unknown key 'trainer.stepz'; did you mean 'trainer.steps'? valid keys of trainer: steps, lr, "),
        (["+seeds=3"], "unknown key 'seeds'; did you mean 'seed'? valid keys: algorithm, kl, reward, model, data, logger, hardware, generation, env, trainer, "),
    ],
)
def test_an_appended_key_is_checked_against_the_options_schema(overrides: list[str], expected: str) -> None:
    assert compose_error(overrides).startswith(expected)


def test_a_wrong_type_names_the_options_field_type() -> None:
    assert compose_error(["algorithm=ppo", "algorithm.gamma=abc"]) == (
        "algorithm.gamma='abc' has the wrong type; expected float"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["kl.coef=nan"], "kl.coef=nan is not a finite number; must be >= 0.0"),
        (["kl.coef=inf"], "kl.coef=inf is not a finite number; must be >= 0.0"),
        (["trainer.lr=nan"], "trainer.lr=nan is not a finite number; must be > 0.0"),
        (["trainer.max_grad_norm=inf"], "trainer.max_grad_norm=inf is not a finite number; must be > 0.0"),
        (["algorithm=ppo", "algorithm.vf_coef=nan"], "algorithm.vf_coef=nan is not a finite number; must be >= 0.0"),
        (["kl.controller=adaptive", "kl.target=nan"], "kl.target=nan must be > 0 with kl.controller=adaptive"),
        (["trainer.top_p=nan"], "trainer.top_p=nan is out of range; must be in (0, 1]"),
    ],
)
def test_nan_and_inf_are_rejected(overrides: list[str], expected: str) -> None:
    assert compose_error(overrides) == expected


SFT_DEMOS = ["model=tiny", "algorithm=sft", "data=demonstrations", "data.path=demos.jsonl"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.max_train_seconds=0"], "trainer.max_train_seconds=0.0 is out of range; must be > 0.0"),
        (["trainer.max_train_seconds=-5"], "trainer.max_train_seconds=-5.0 is out of range; must be > 0.0"),
        (["trainer.max_train_seconds=inf"], "trainer.max_train_seconds=inf is not a finite number; must be > 0.0"),
        ([*SFT_DEMOS, "algorithm.packing_length=1"], "algorithm.packing_length=1 is out of range; must be >= 2"),
    ],
)
def test_a_time_budget_and_a_packing_length_must_be_positive(overrides: list[str], expected: str) -> None:
    assert compose_error(overrides) == expected


def test_a_time_budget_and_packing_default_to_off() -> None:
    assert compose([]).trainer.max_train_seconds is None
    assert compose(["trainer.max_train_seconds=600"]).trainer.max_train_seconds == 600.0
    algorithm = compose(SFT_DEMOS).algorithm
    assert (algorithm.packing, algorithm.packing_length) == (False, None)


def test_experiment_selects_with_or_without_plus() -> None:
    plain, plus = compose(["experiment=smoke"]), compose(["+experiment=smoke"])
    assert OmegaConf.to_container(plain) == OmegaConf.to_container(plus)
    assert plain.experiment_name == "smoke"
    assert plain.model.name == "tiny" and OmegaConf.get_type(plain.model) is TinyModelConfig
    assert (plain.trainer.steps, plain.algorithm.group_size) == (2, 2)  # the experiment overrides the root
    assert compose([]).experiment_name == "default"


def test_an_override_after_the_experiment_wins() -> None:
    cfg = compose(["experiment=smoke", "trainer.steps=5", "model=smollm2_135m"])
    assert (cfg.trainer.steps, cfg.model.name, cfg.experiment_name) == (5, "smollm2_135m", "smoke")


@pytest.fixture
def registered() -> Iterator[list[tuple[str, str]]]:
    """Register test parts; remove them from the registry afterwards."""
    added: list[tuple[str, str]] = []
    yield added
    for kind, name in added:
        registry._REGISTRY[kind].pop(name, None)


def _register(added: list[tuple[str, str]], kind: str, name: str, obj: object) -> None:
    registry.register(kind, name)(obj)
    added.append((kind, name))


@pytest.mark.parametrize(
    ("kind", "key", "overrides"),
    [
        ("kl_placement", "kl.placement", []),
        ("kl_controller", "kl.controller", []),
        ("loss_aggregation", "algorithm.loss_aggregation", []),
        ("baseline", "algorithm.baseline", ["algorithm=reinforce"]),
        ("kl", "kl.name", []),
    ],
)
def test_choices_come_from_the_registry(registered, kind: str, key: str, overrides: list[str]) -> None:
    message = compose_error([*overrides, f"{key}=test_only_choice"])
    assert message.startswith(f"{key.removesuffix('.name')}='test_only_choice' is not valid; choose from: ")
    assert message.endswith(", ".join(registry.names(kind)))
    _register(registered, kind, "test_only_choice", object())
    assert compose([*overrides, f"{key}=test_only_choice"])[key.split(".")[0]][key.split(".")[1]] == "test_only_choice"


def test_group_size_minimum_comes_from_the_algorithm_class(registered) -> None:
    assert compose_error(["algorithm=grpo", "algorithm.group_size=1"]) == (
        "algorithm.group_size=1 is too small for algorithm=grpo; must be >= 2"
    )
    assert compose_error(["algorithm=rloo", "algorithm.group_size=1"]) == (
        "algorithm.group_size=1 is too small for algorithm=rloo; must be >= 2"
    )
    assert compose(["algorithm=reinforce", "algorithm.group_size=1"]).algorithm.baseline == "batch_mean"
    assert compose(["algorithm=ppo", "algorithm.group_size=1", "algorithm.mini_batch_size=2"])

    class NeedsThree:
        @classmethod
        def min_group_size(cls, cfg) -> int:
            return 3

    class NoMinimum:  # an algorithm without the classmethod accepts any group size >= 1
        pass

    _register(registered, "algorithm", "test_needs_three", NeedsThree)
    _register(registered, "algorithm", "test_no_minimum", NoMinimum)
    assert compose_error(["algorithm.name=test_needs_three", "algorithm.group_size=2"]) == (
        "algorithm.group_size=2 is too small for algorithm=test_needs_three; must be >= 3"
    )
    assert compose(["algorithm.name=test_no_minimum", "algorithm.group_size=1"]).algorithm.group_size == 1


def test_unknown_option_lists_the_yaml_options() -> None:
    assert compose_error(["algorithm=grpo_schema"]) == (
        f"algorithm='grpo_schema' is not an option; choose from: {', '.join(sorted(SCHEMAS['algorithm']))}"
    )
    assert compose_error(["+experiment=nope"]) == (
        "experiment='nope' is not an option; choose from: algo_comparison, algo_comparison_exact, async_drop_bias, "
        "async_kl, exact, "
        "exact_two_turn, grpo_kl_scale, kl_ablation, kl_ablation_exact, kl_placement_bias, kl_to_go, mode_collapse, "
        "multi_turn_mask, off_policy_kl, smoke"
    )
