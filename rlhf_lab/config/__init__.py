"""Configuration: structured schemas per option (:mod:`.schema`), validation (:mod:`.validate` and the
``validate_*`` modules it calls) and composition (:mod:`.compose`, the one entry every caller uses)."""

from rlhf_lab.config.compose import CONF_DIR, compose
from rlhf_lab.config.schema import Config, register_configs
from rlhf_lab.config.schema_offline import OfflineAlgorithmConfig  # noqa: F401  (the offline stages' schemas)
from rlhf_lab.config.validate import validate
from rlhf_lab.errors import ConfigError

__all__ = ["CONF_DIR", "Config", "ConfigError", "compose", "register_configs", "validate"]
