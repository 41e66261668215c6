"""``rlhf-lab --help`` (conf/hydra/help/rlhf_lab.yaml): the option lists it shows, computed when asked.

``${rlhf_lab_help:groups}`` lists each config group's options (schemas, ``*_schema``, are not options) and
``${rlhf_lab_help:launchers}`` / ``${rlhf_lab_help:sweepers}`` the installed launchers and sweepers.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def help_text(what: str) -> str:
    from rlhf_lab.config.conf_dir import CONF_DIR
    from rlhf_lab.config.sweep_jobs import GROUPS, group_options
    from rlhf_lab.config.validate_sweep import plugin_options

    if what == "groups":  # the run's groups first, then every other folder of conf/ (the sweeps' arms)
        others = sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir() and path.name not in (*GROUPS, "hydra"))
        return "\n".join(f"  {group}: {', '.join(group_options(group))}" for group in (*GROUPS, *others)
                         if group_options(group))
    if what in ("launchers", "sweepers"):
        return ", ".join(plugin_options(what[:-1], CONF_DIR))
    return ""


def register_help() -> None:
    if not OmegaConf.has_resolver("rlhf_lab_help"):
        OmegaConf.register_new_resolver("rlhf_lab_help", help_text)
