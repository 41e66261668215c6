"""Where the Hydra tree is found (rlhf_lab/config/conf_dir.py): inside an installed package, else beside it."""

from __future__ import annotations

from pathlib import Path

from rlhf_lab.config.conf_dir import CONF_DIR, find_conf_dir

REPOSITORY = Path(__file__).resolve().parents[2]


def test_a_checkout_composes_from_conf_at_the_top() -> None:
    assert CONF_DIR == REPOSITORY / "conf" and (CONF_DIR / "config.yaml").is_file()
    assert not (REPOSITORY / "rlhf_lab" / "conf").exists()  # one tree, not two


def test_a_package_without_its_tree_is_a_checkout(tmp_path: Path) -> None:
    assert find_conf_dir(tmp_path / "repository" / "rlhf_lab") == tmp_path / "repository" / "conf"


def test_an_installed_package_uses_the_tree_it_carries(tmp_path: Path) -> None:
    package = tmp_path / "site" / "rlhf_lab"
    (package / "conf").mkdir(parents=True)
    (package / "conf" / "config.yaml").write_text("defaults: []\n")
    (tmp_path / "site" / "conf").mkdir()  # another distribution's top-level conf/ in site-packages: not ours
    assert find_conf_dir(package) == package / "conf"
