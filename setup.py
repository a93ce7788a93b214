"""Packaging beside pyproject.toml: the Ray layer's folder, workers/, installs under the
project's own import name, ray_zep_workers, next to ray_zep and its subpackages."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["ray_zep", "ray_zep.*"]), "ray_zep_workers"],
    package_dir={"ray_zep_workers": "workers"},
)
