"""Imports run one way. The core (`h3gen.errors`, `h3gen.linear`, `h3gen.loading`, `h3gen.quant`, `h3gen.parallel`,
`h3gen.media`) and `h3gen.kernels` sit at the bottom, `h3gen.pipelines` and `h3gen.offload` above them, the server,
the CLI and the UI on top.

Every import of every module under `h3gen/`, `kernels/`, `pipelines/`, `offload/` and `ui/` is read from its source
(module level, inside functions and classes, under `if TYPE_CHECKING`), with the folders named as pyproject.toml's
`package-dir` installs them, so an import inside a function cannot hide an upward one. No chain of imports may come
back to the module it started from either.
"""

import ast
import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The floor of every module, found by its longest listed dotted prefix ("h3gen" itself names only the package root).
# A module outside these names fails `test_every_module_has_a_floor` until it is placed here.
FLOORS = {
    "h3gen": "api",  # the package root: the public API, whose lazy attributes reach the pipeline
    "h3gen.errors": "errors",
    "h3gen.checkout_names": "names",  # what a top-level folder does when imported by its bare name (standard library)
    "h3gen.quant.mxfp4_format": "format",
    "h3gen.linear_spec": "spec",
    "h3gen.kernels": "kernels",
    "h3gen.quant": "quant",
    "h3gen.parallel": "parallel",
    "h3gen.linear": "linear",
    "h3gen.lora": "lora",  # unmerged LoRA on any linear of h3gen.linear (model-agnostic)
    "h3gen.loading": "loading",
    "h3gen.media": "media",
    "h3gen.device_memory": "device",  # how the CUDA allocator manages a pipeline's device memory
    "h3gen.options": "options",  # the run options every face validates against
    "h3gen.pipelines": "pipelines",
    "h3gen.offload": "offload",
    "h3gen.server": "server",
    "h3gen.client": "server",  # the REST client: the server's client-side piece
    "h3gen.cli": "cli",
    "h3gen.envreport": "cli",  # `h3gen env`
    "h3gen.ui": "ui",
}
ALL = frozenset(FLOORS.values())
CORE = frozenset(
    {"errors", "format", "spec", "quant", "parallel", "linear", "lora", "loading", "media", "options", "device"}
)
TOP = frozenset({"server", "cli", "ui", "api"})


@dataclass(frozen=True)
class Rule:
    importers: frozenset[str]
    forbidden: frozenset[str]
    text: str


def _alone(floor: str, text: str) -> Rule:
    return Rule(frozenset({floor}), ALL - {floor}, text)


RULES = (
    _alone("errors", "h3gen.errors imports nothing else of h3gen"),
    _alone("names", "h3gen.checkout_names imports nothing else of h3gen"),
    _alone("format", "the MXFP4 format (h3gen.quant.mxfp4_format) imports nothing else of h3gen"),
    _alone("spec", "h3gen.linear_spec (what a model asks of a linear) imports nothing else of h3gen"),
    Rule(
        frozenset({"kernels"}),
        ALL - {"kernels", "format", "names"},
        "kernels import no other h3gen package but the MXFP4 format (h3gen.quant.mxfp4_format)",
    ),
    Rule(
        CORE,
        frozenset({"pipelines", "offload"}) | TOP,
        "the core (errors, linear, lora, loading, quant, parallel, media, options) imports neither pipelines, offload, "
        "server, cli, ui nor the package root",
    ),
    Rule(
        frozenset({"quant"}),
        frozenset({"parallel", "linear", "loading"}),
        "quant sits below the tensor-parallel linears and the linear factory (h3gen.linear), which use it",
    ),
    Rule(
        frozenset({"parallel"}),
        frozenset({"linear", "loading"}),
        "parallel sits below the linear factory (h3gen.linear), which builds its linears",
    ),
    Rule(
        frozenset({"quant", "parallel", "linear", "loading"}),
        frozenset({"lora"}),
        "h3gen.lora sits above the linears it adapts (quant, parallel, linear)",
    ),
    Rule(
        frozenset({"loading"}),
        frozenset({"quant", "parallel", "linear"}),
        "loading reads and places tensors; which layers a model has is decided by its loader in pipelines/",
    ),
    Rule(
        frozenset({"pipelines", "offload"}),
        TOP,
        "pipelines and offload import neither server, cli, ui nor the package root",
    ),
    Rule(frozenset({"server"}), frozenset({"ui", "cli", "api"}), "the server imports neither ui nor cli"),
    Rule(frozenset({"ui"}), frozenset({"cli"}), "the UI may import the server's public pieces, never the CLI"),
)


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    importer: str  # dotted module names
    target: str


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


@functools.cache
def package_dirs() -> dict[str, str]:
    """Import prefix -> folder, as pyproject.toml's `[tool.setuptools] package-dir` installs them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def module_name(path: str) -> str | None:
    """`kernels/moe/reference.py` -> `h3gen.kernels.moe.reference` (None for a file outside the mapped folders)."""
    parts = Path(path).with_suffix("").parts
    for prefix, folder in sorted(package_dirs().items(), key=lambda item: -len(Path(item[1]).parts)):
        head = Path(folder).parts
        if parts[: len(head)] == head:
            rest = [p for p in parts[len(head) :] if p != "__init__"]
            return ".".join([prefix, *rest])
    return None


def tree_sources() -> dict[str, str]:
    """Relative path -> source of every module in the mapped folders."""
    sources = {}
    for folder in package_dirs().values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            sources[path.relative_to(ROOT).as_posix()] = path.read_text()
    return sources


def floor_of(module: str) -> str | None:
    if module == "h3gen":
        return FLOORS["h3gen"]
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        floor = FLOORS.get(".".join(parts[:end]))
        if floor is not None:
            return floor
    return None


def read_imports(path: str, source: str, modules: set[str]) -> list[Import]:
    """Every h3gen import in `source`, wherever it sits; `from X import y` names module `X.y` when that exists."""
    importer = module_name(path)
    package = importer if path.endswith("__init__.py") else importer.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target == "h3gen" or target.startswith("h3gen."):
                found.append(Import(path, node.lineno, importer, target))
    return found


def direction_problems(imports: list[Import]) -> list[Problem]:
    problems = []
    for imp in imports:
        source, target = floor_of(imp.importer), floor_of(imp.target)
        for rule in RULES:
            if source in rule.importers and target in rule.forbidden:
                problems.append(
                    Problem(
                        imp.path, imp.line, f"{imp.importer} ({source}) imports {imp.target} ({target}): {rule.text}"
                    )
                )
    return problems


def cycle_problems(imports: list[Import], modules: set[str]) -> list[Problem]:
    """One problem per import that lies on a cycle, naming its file:line and one loop through it."""
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        if imp.target in modules and imp.target != imp.importer:
            edges.setdefault(imp.importer, {}).setdefault(imp.target, []).append(imp)
    problems = []
    for component in _strongly_connected(edges):
        for a in sorted(component):
            for b in sorted(set(edges.get(a, {})) & component):
                loop = " -> ".join([a, *_path(b, a, edges, component)])
                problems += [
                    Problem(imp.path, imp.line, f"{a} imports {b}, which leads back to it: {loop}")
                    for imp in edges[a][b]
                ]
    return problems


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iterative."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    nodes = set(edges) | {t for targets in edges.values() for t in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _path(start: str, goal: str, edges: dict[str, dict], component: set[str]) -> list[str]:
    """A shortest import chain from `start` to `goal` inside `component` (breadth first)."""
    parents, frontier = {start: None}, [start]
    while goal not in parents:
        following = []
        for node in frontier:
            for child in sorted(set(edges.get(node, {})) & component - set(parents)):
                parents[child] = node
                following.append(child)
        frontier = following
    chain = [goal]
    while chain[-1] != start:
        chain.append(parents[chain[-1]])
    return chain[::-1]


def tree_imports(sources: dict[str, str]) -> tuple[list[Import], set[str]]:
    """Every h3gen import of the modules `sources` holds, and those modules' names."""
    modules = {module_name(path) for path in sources}
    return [imp for path, source in sources.items() for imp in read_imports(path, source, modules)], modules


def check(sources: dict[str, str]) -> list[Problem]:
    """Every import against the direction rules, then every import cycle, in the modules `sources` holds."""
    imports, modules = tree_imports(sources)
    return direction_problems(imports) + cycle_problems(imports, modules)


def _report(problems: list[Problem]) -> str:
    return "imports against the allowed direction or on a cycle:\n" + "\n".join(str(p) for p in problems)


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in map(module_name, tree_sources()) if floor_of(m) is None)
    assert not unplaced, f"place these modules in FLOORS: {unplaced}"


def test_imports_run_one_way():
    problems = direction_problems(tree_imports(tree_sources())[0])
    assert not problems, _report(problems)


def test_no_import_cycles():
    problems = cycle_problems(*tree_imports(tree_sources()))
    assert not problems, _report(problems)


# Upward imports, each added to the tree as source text (some inside a function, where an import is easy to
# overlook): the checker must report the added line. `parallel/tp_linear.py` importing `quant.mxfp4` is wrong only
# as the way back of a cycle, so that case adds both directions and expects the cycle.
_BACK_TO_PARALLEL = "\n\ndef _factory():\n    from h3gen.parallel.tp_linear import ColumnParallelMXFP4Linear\n"
_QUANT_LINEAR = "\nfrom h3gen.quant.mxfp4 import MXFP4Linear\n"
INJECTED = {  # case -> [(file, source text appended, whether the checker must point at it)]
    "quant imports parallel": [("h3gen/quant/mxfp4.py", _BACK_TO_PARALLEL, True)],
    "parallel imports quant back": [
        ("h3gen/quant/mxfp4.py", _BACK_TO_PARALLEL, False),
        ("h3gen/parallel/tp_linear.py", _QUANT_LINEAR, True),
    ],
    "mxfp4_gemm init imports quant": [
        ("kernels/mxfp4_gemm/__init__.py", "\n\ndef _widen():\n    from h3gen.quant.mxfp4 import MXFP4Linear\n", True)
    ],
    "mxfp4_gemm reference imports quant": [("kernels/mxfp4_gemm/reference.py", _QUANT_LINEAR, True)],
    "moe reference imports quant": [("kernels/moe/reference.py", _QUANT_LINEAR, True)],
    "parallel model imports the transformer": [
        (
            "h3gen/parallel/model.py",
            "def parallel_transformer(config):\n    from h3gen.pipelines.h3.transformer import H3Transformer\n",
            True,
        )
    ],
    "server imports ui": [("h3gen/server/app.py", "\n\ndef _ui():\n    from h3gen.ui.blocks import build_ui\n", True)],
}


@pytest.mark.parametrize("case", list(INJECTED))
def test_checker_reports_an_upward_import_added_to_the_tree(case):
    sources = tree_sources()
    expected = []
    for path, added, reported in INJECTED[case]:
        before = sources.get(path, "")
        before += "\n" if before and not before.endswith("\n") else ""
        sources[path] = before + added
        lines = range(before.count("\n") + 1, before.count("\n") + added.count("\n") + 1)
        if reported:
            expected.append((path, lines))
    problems = check(sources)
    for path, lines in expected:
        hits = [p for p in problems if p.path == path and p.line in lines]
        assert hits, f"{case}: nothing reported at {path}:{lines.start}-{lines.stop - 1}; got:\n" + _report(problems)
        assert all(":" in str(hit) and hit.text for hit in hits)


def test_relative_and_from_imports_name_the_module():
    modules = {"h3gen.quant.mxfp4", "h3gen.quant", "h3gen.kernels.moe", "h3gen.kernels.moe.reference"}
    source = "from . import mxfp4\nfrom ..quant import mxfp4 as m\nimport h3gen.quant.mxfp4\n"
    found = read_imports("kernels/moe/reference.py", "from ...quant import mxfp4\n", modules)
    assert [i.target for i in found] == ["h3gen.quant.mxfp4"]
    found = read_imports("h3gen/quant/fp8.py", source, modules)
    assert [(i.line, i.target) for i in found] == [
        (1, "h3gen.quant.mxfp4"),
        (2, "h3gen.quant.mxfp4"),
        (3, "h3gen.quant.mxfp4"),
    ]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_problems(path: str, source: str, modules: set[str], importer: str | None) -> list[Problem]:
    """Each use of another h3gen module's private (`_name`) names in `source`: `from X import _y`, and `m._y` where
    `m` is an h3gen module it imported (`import h3gen.x as m`, `from h3gen import x as m`). A package may use its own
    modules' private names only from inside the same module."""
    aliases, problems = {}, []
    tree = ast.parse(source, filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h3gen") and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif _is_private(alias.name) and node.module != importer:
                    problems.append(Problem(path, node.lineno, f"imports {node.module}'s private name {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("h3gen") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _is_private(node.attr)
            and aliases[node.value.id] != importer
        ):
            problems.append(Problem(path, node.lineno, f"uses {aliases[node.value.id]}'s private name {node.attr}"))
    return problems


def benchmark_sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted((ROOT / "benchmarks").rglob("*.py"))}


def test_no_module_uses_another_modules_private_names():
    sources = tree_sources()
    modules = {module_name(path) for path in sources}
    problems = []
    for path, source in {**sources, **benchmark_sources()}.items():
        problems += private_problems(path, source, modules, module_name(path))
    assert not problems, "private names used across modules (make them public, or keep the use inside):\n" + "\n".join(
        str(p) for p in problems
    )


def test_private_name_checker_reports_both_forms():
    modules = {"h3gen.pipelines.h3.video_decode", "h3gen.media"}
    source = (
        "from h3gen.pipelines.h3 import video_decode\nfrom h3gen.media import _shown, probe_mp4\n"
        "video_decode._tiles(1, 2)\nvideo_decode.decode(1)\n"
    )
    problems = private_problems("benchmarks/x.py", source, modules, None)
    assert [(p.line, p.text.split()[-1]) for p in problems] == [(2, "_shown"), (3, "_tiles")]
    assert not private_problems("h3gen/media/x.py", "from h3gen.media.x import _own\n", modules, "h3gen.media.x")


def test_package_exports_name_no_submodule():
    """A lazily exported name equal to a submodule's name would resolve to the submodule once it is imported."""
    import h3gen.pipelines.h3 as h3

    submodules = {path.stem for path in (ROOT / "pipelines" / "h3").glob("*.py")}
    assert not set(h3.__all__) & submodules
