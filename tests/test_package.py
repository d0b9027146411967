"""The installed package: one `h3gen` namespace, the console script, the environment report, the environment
variables it reads (each documented in the README)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import h3gen

IMPORTS = (
    "import h3gen, h3gen.kernels, h3gen.pipelines, h3gen.offload, h3gen.ui, h3gen.loading, h3gen.pipelines.h3, "
    "h3gen.pipelines.k3.model, h3gen.kernels.kda, h3gen.kernels.mla_decode, h3gen.kernels.moe"
)


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # installs into a fresh environment: 5 s
def test_one_namespace_and_no_top_level_packages(tmp_path):
    # Run from an empty folder so the source tree on the current directory cannot satisfy the imports.
    result = _python(IMPORTS + '; import sys; print(sys.modules["h3gen.kernels.attention"].__name__)', tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "h3gen.kernels.attention"
    # Top-level names found (other distributions own some: transformers installs `kernels`) are never ours.
    check = (
        "import importlib.util as u; specs = [u.find_spec(n) for n in ('kernels','pipelines','offload','ui')]; "
        "print([s.origin for s in specs if s is not None])"
    )
    result = _python(check, tmp_path)
    assert result.returncode == 0, result.stderr
    assert not any(str(ROOT) in origin or "h3gen" in origin for origin in eval(result.stdout))


SHADOW_CHECK = """
import json, sys
import kernels, ui, pipelines, offload
import h3gen.kernels.attention_backends, h3gen.pipelines.h3.geometry, h3gen.offload
from transformers.integrations import hub_kernels  # imports the PyPI `kernels` when installed
print(json.dumps({name: sys.modules[name].__file__ for name in ("kernels", "ui", "pipelines", "offload",
                                                                 "h3gen.kernels", "h3gen.offload")}))
"""


@pytest.mark.slow  # installs into a fresh environment: 5 s
def test_checkout_root_never_shadows_installed_distributions(tmp_path):
    """Python started in the checkout root (the current directory first on sys.path, as `python -m pytest` or a REPL
    there) imports the installed distributions named kernels, ui, pipelines and offload, not our folders of those
    names, and h3gen beside them; with none installed, the bare names do not import at all."""
    import kernels

    assert Path(kernels.__file__).parent.parent != ROOT, "the PyPI kernels (a transformers dependency) is installed"
    site = tmp_path / "site"
    for name in ("ui", "pipelines", "offload"):  # stand-ins for distributions of these names
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    result = subprocess.run(
        [sys.executable, "-c", SHADOW_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    files = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(files["kernels"]).parent == Path(kernels.__file__).parent
    for name in ("ui", "pipelines", "offload"):
        assert Path(files[name]).parent == site / name
    assert Path(files["h3gen.kernels"]).parent == ROOT / "kernels"
    assert Path(files["h3gen.offload"]).parent == ROOT / "offload"

    bare = "import ui"
    result = subprocess.run([sys.executable, "-c", bare], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "ModuleNotFoundError: No module named 'ui'" in result.stderr, result.stderr
    assert "h3gen.ui" in result.stderr
    version = subprocess.run(
        [sys.executable, "-m", "h3gen.cli", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.strip() == f"h3gen {h3gen.__version__}", version.stderr


def test_cli_version_and_env(tmp_path):
    version = subprocess.run([sys.executable, "-m", "h3gen.cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"h3gen {h3gen.__version__}"
    env = subprocess.run([sys.executable, "-m", "h3gen.cli", "env"], capture_output=True, text=True, timeout=120)
    assert env.returncode == 0, env.stderr
    labels = [line.split()[0] for line in env.stdout.splitlines()]
    for label in ("h3gen", "python", "torch", "diffusers", "cuda", "encoders"):
        assert label in labels


def test_public_api_exports():
    assert issubclass(h3gen.RequestError, ValueError)
    assert h3gen.H3Transformer.__module__ == "h3gen.pipelines.h3.transformer"


@pytest.mark.slow  # installs into a fresh environment: 5 s
def test_regular_install_has_the_same_namespace(tmp_path):
    # A non-editable install copies the mapped folders under h3gen/ and nothing else at the top level.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    top_level = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top_level == ["h3gen"]
    for sub in (
        "kernels",
        "pipelines/h3",
        "pipelines/k3",
        "kernels/kda",
        "kernels/mla_decode",
        "kernels/moe",
        "kernels/gemv",
        "offload",
        "ui",
        "loading",
    ):
        assert (target / "h3gen" / sub / "__init__.py").exists(), sub


ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("h3gen", "kernels", "pipelines", "offload", "ui")


def test_every_environment_variable_read_is_in_the_readme_table():
    reads = set()
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            reads |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"']([A-Z0-9_]+)[\"']", text))
            reads |= set(re.findall(r"[\"']([A-Z0-9_]+)[\"']\s+in\s+os\.environ", text))
    assert {"H3GEN_TRITON", "H3GEN_API_KEY", "LOCAL_RANK", "WORLD_SIZE"} <= reads  # the scan finds what it should
    table = (ROOT / "README.md").read_text().split("## Environment variables", 1)[1]
    documented = set(re.findall(r"`([A-Z0-9_]+)(?:=[^`]*)?`", table))
    assert reads <= documented, f"read but not in the README's table: {sorted(reads - documented)}"


def test_the_architecture_page_lists_every_package_folder():
    """docs/architecture.md's folder table names every package folder of the tree (a folder of the installed
    folders holding an `__init__.py`), with the import name pyproject.toml's `package-dir` gives it, and names no
    folder the tree lacks."""
    import tomllib

    page = (ROOT / "docs" / "architecture.md").read_text().split("## Folders", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([^`]+)/` \| (?:`([a-z0-9_.]+)`)? *\|", page, flags=re.M))
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = {}
    for name, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            packages[(init.parent.relative_to(ROOT)).as_posix()] = ".".join([name, *relative])
    assert "h3gen/server" in packages and "kernels/moe" in packages  # the scan finds what it should
    missing = sorted(set(packages) - set(rows))
    assert not missing, f"package folders without a row in docs/architecture.md's folder table: {missing}"
    absent = sorted(folder for folder in rows if not (ROOT / folder).is_dir())
    assert not absent, f"docs/architecture.md lists folders the tree lacks: {absent}"
    wrong = {folder: rows[folder] for folder in packages if rows[folder] != packages[folder]}
    assert not wrong, f"import names in docs/architecture.md that differ from the installed ones: {wrong}"


FAST_MOVING = (
    "torch",
    "triton",
    "transformers",
    "huggingface-hub",
    "accelerate",
    "pydantic",
    "fastapi",
    "starlette",
    "uvicorn",
    "gradio",
    "psycopg",
    "peft",
    "schemathesis",
    "playwright",
    "openai",
    "kernels",
    "ruff",
)


def test_fast_moving_dependencies_stop_at_a_tested_minor_release():
    """Each fast-moving dependency has an upper bound below its next minor release (`<X.Y`), so a fresh install
    cannot take an untested one, and the installed version is within the bounds (README, "Dependency versions")."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["test"]]
    by_name = {requirement.name.lower(): requirement for requirement in requirements}
    for name in FAST_MOVING:
        requirement = by_name[name]
        uppers = [spec for spec in requirement.specifier if spec.operator == "<"]
        assert uppers and len(Version(uppers[0].version).release) == 2, f"{requirement}: no <X.Y bound"
        if requirement.marker is None or requirement.marker.evaluate():
            assert Version(version(name)) in requirement.specifier, (name, version(name))
    assert str(by_name["diffusers"].specifier) == "==0.42.1"
