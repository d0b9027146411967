"""The installed package: one `h3gen` namespace, the console script, the environment report, the environment
variables it reads (each documented in the README)."""

import re
import subprocess
import sys
from pathlib import Path

import h3gen

IMPORTS = ("import h3gen, h3gen.kernels, h3gen.pipelines, h3gen.offload, h3gen.ui, h3gen.loading, h3gen.pipelines.h3, "
           "h3gen.pipelines.k3.model, h3gen.kernels.kda, h3gen.kernels.mla_decode, h3gen.kernels.moe")


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_one_namespace_and_no_top_level_packages(tmp_path):
    # Run from an empty folder so the source tree on the current directory cannot satisfy the imports.
    result = _python(IMPORTS + "; import sys; print(sys.modules[\"h3gen.kernels.attention\"].__name__)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "h3gen.kernels.attention"
    check = "import importlib.util as u; print([n for n in ('kernels','pipelines','offload','ui') if u.find_spec(n)])"
    result = _python(check, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


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


def test_regular_install_has_the_same_namespace(tmp_path):
    # A non-editable install copies the mapped folders under h3gen/ and nothing else at the top level.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(root)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    top_level = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top_level == ["h3gen"]
    for sub in ("kernels", "pipelines/h3", "pipelines/k3", "kernels/kda", "kernels/mla_decode", "kernels/moe",
                "kernels/gemv", "offload", "ui", "loading"):
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
