"""Package list for the one-namespace layout (README, "Layout"): each top-level folder installs under `h3gen.*`.

pyproject.toml maps the folders with `package-dir`; setuptools' package discovery cannot follow such a mapping, so
the packages are listed here by walking each folder.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "h3gen": "h3gen",
    "h3gen.kernels": "kernels",
    "h3gen.pipelines": "pipelines",
    "h3gen.offload": "offload",
    "h3gen.ui": "ui",
}

packages = []
for package, folder in FOLDERS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages)
