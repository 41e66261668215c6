"""The package's file layout for setuptools (the rest of the metadata is in pyproject.toml).

The Hydra tree lives at the top of the repository (``conf/``, beside ``rlhf_lab/``), where a reader browsing the
repository looks for it; the wheel carries it inside the package as ``rlhf_lab/conf`` (the ``package_dir`` mapping
below), so a ``pip install`` and a checkout see the same tree. ``benchmarks/`` stays out of the wheel.
"""

from setuptools import find_namespace_packages, setup

CONF_PACKAGES = ["rlhf_lab.conf", *(f"rlhf_lab.conf.{name}" for name in find_namespace_packages("conf"))]

setup(
    packages=find_namespace_packages(include=["rlhf_lab*", "hydra_plugins*"]) + CONF_PACKAGES,
    package_dir={"rlhf_lab.conf": "conf"},
    package_data={"rlhf_lab": ["assets/**/*"], **{name: ["*.yaml"] for name in CONF_PACKAGES}},
)
