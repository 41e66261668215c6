"""Where the Hydra tree is: ``conf/`` at the top of a repository checkout, ``rlhf_lab/conf`` in an installed wheel.

The repository keeps the tree beside the package, where a reader browsing it looks; the build maps that folder into
the wheel as ``rlhf_lab/conf`` (setup.py), so a ``pip install`` and a checkout (editable install, or the sources on
``PYTHONPATH``) compose from the same files. A user's own options join through Hydra's search path
(``--config-dir conf``, ``hydra.searchpath=[...]``), never by editing this tree.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def find_conf_dir(package_dir: Path = PACKAGE_DIR) -> Path:
    """``package_dir/conf`` when the package carries the tree (an installed wheel), else ``conf/`` beside the package
    (the repository's layout)."""
    shipped = package_dir / "conf"
    return shipped if (shipped / "config.yaml").is_file() else package_dir.parent / "conf"


CONF_DIR = find_conf_dir()
