"""Which layer may import which, read from the source with `ast` (nothing is imported).

The rules (docs/testing.md#layers):
- the router never imports the engine, the kernels or the benchmarks, and nothing it
  loads needs more than the base install (no torch, triton, safetensors, numpy);
- the engine never imports the router or the benchmarks;
- the shared rules (`omnibus.common`) import only `omnibus.v1` and the base install's
  dependencies; the generated code (`omnibus.v1`) only itself; the kernels only themselves;
- `omnibus.engine.core` is torch-free: what it loads at run time stays inside core and the
  shared rules (an `if TYPE_CHECKING:` import may name a higher layer, as annotations do);
- nothing in the engine imports a higher layer at run time (ENGINE_LAYERS).

A chain counts: a module "imports" whatever the modules it imports load in turn, including
each package's `__init__`. Module names come from pyproject's package-dir mapping, so
`router/omnibus/router/x.py` is `omnibus.router.x`, as installed.

The source layout (docs/testing.md#source-layout) is checked here too: every file's path
under its source root is its import name, and every `omnibus.*` import in the tree (tests
and scripts included) resolves by path alone, as a type checker or editor resolves it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.grpc_helpers import ROOT


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    path: Path  # its file
    line: int
    target: str  # an omnibus module, or a third-party import's top-level name
    runtime: bool  # False inside `if TYPE_CHECKING:`

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def module_files(root: Path, pyproject: dict) -> dict[str, Path]:
    """Every module of the distribution by its installed name (package -> __init__.py)."""
    setuptools = pyproject["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    found = {}
    for package in setuptools["packages"]:
        owner = max((name for name in folders if within(name)(package)), key=len)
        folder = root / folders[owner] / Path(*package.split(".")[owner.count(".") + 1 :])
        for path in folder.glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(body: Iterable[ast.stmt], runtime: bool) -> Iterable[tuple[ast.stmt, bool]]:
    """Every statement with whether it runs (imports inside functions do, when called)."""
    for node in body:
        yield node, runtime
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, False)
            yield from _walk(node.orelse, runtime)
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                if isinstance(child, ast.stmt):
                    yield from _walk([child], runtime)
                else:  # except handlers, match cases
                    yield from _walk(child.body, runtime)


def parse_imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """`module`'s imports: omnibus modules by full name, anything else by its top-level
    name; the standard library left out. `from pkg import name` is the module
    `pkg.name` when there is one, else `pkg`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node, runtime in _walk(ast.parse(path.read_text(), str(path)).body, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            # `omnibus` itself is a namespace (no module): `from omnibus import kernels`
            names = [base] * (base != "omnibus") + [name for name in subs if name in modules]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            target = name if top == "omnibus" or top in modules else top
            found.append(Import(module, path, node.lineno, target, runtime))
    return found


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # a distribution's normalized name


class Graph:
    def __init__(self, root: Path, pyproject: dict):
        self.root = root
        self.modules = module_files(root, pyproject)
        self.imports = {m: parse_imports(m, p, self.modules) for m, p in self.modules.items()}
        # the top-level import names the base install's dependencies provide
        base = {_dist(Requirement(r).name) for r in pyproject["project"]["dependencies"]}
        self.base_names = {top for top, dists in importlib.metadata.packages_distributions().items()
                           if base & set(map(_dist, dists))}

    def loads(self, target: str) -> list[str]:
        """The modules importing `target` runs: each enclosing package's __init__, then it."""
        parts = target.split(".")
        return [m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in self.modules]

    def violations(
        self,
        sources: Callable[[str], bool],
        forbidden: Callable[[str], bool],
        chain: bool = True,
        type_checking: bool = True,
    ) -> list[str]:
        """Each import of a `forbidden` target by a module in `sources` (TYPE_CHECKING ones
        too, unless `type_checking` is False) or, with `chain`, by a module they load at run
        time: its file:line, then the shortest chain of imports that reaches it."""
        found: dict[Import, list[Import]] = {}
        for start in sorted(filter(sources, self.modules)):
            hops: dict[str, list[Import]] = {start: []}  # how `start` comes to load a module
            queue = [start]
            while queue:
                module = queue.pop(0)
                for imp in self.imports[module]:
                    if forbidden(imp.target):
                        if imp.runtime or (module == start and type_checking):
                            if imp not in found or len(hops[module]) < len(found[imp]):
                                found[imp] = hops[module]
                        continue
                    if chain and imp.runtime and imp.target in self.modules:
                        for loaded in self.loads(imp.target):
                            if loaded not in hops:
                                hops[loaded] = [*hops[module], imp]
                                queue.append(loaded)
        lines = []
        for imp, via in found.items():
            line = f"{imp.where(self.root)} imports {imp.target}"
            if via:
                steps = " > ".join(f"{hop.where(self.root)} imports {hop.target}" for hop in via)
                line += f", loaded by {via[0].source}: {steps}"
            lines.append(line)
        return sorted(lines)


def within(*packages: str) -> Callable[[str], bool]:
    """A module in one of `packages` (the package itself or below it)."""
    return lambda m: any(m == p or m.startswith(p + ".") for p in packages)


def other_omnibus(*packages: str) -> Callable[[str], bool]:
    """An omnibus module outside `packages`."""
    return lambda t: t.startswith("omnibus.") and not within(*packages)(t)


GRAPH = Graph(ROOT, tomllib.loads((ROOT / "pyproject.toml").read_text()))


def beyond_base(target: str) -> bool:
    """A third-party import that the base (torch-free) install does not provide."""
    return not target.startswith("omnibus") and target not in GRAPH.base_names


def check(rule: str, sources: Callable[[str], bool], forbidden: Callable[[str], bool],
          **options: bool) -> None:
    problems = GRAPH.violations(sources, forbidden, **options)
    assert not problems, rule + ":\n  " + "\n  ".join(problems)


def test_every_omnibus_import_names_a_module():
    imports = [imp for imps in GRAPH.imports.values() for imp in imps]
    unknown = [f"{imp.where(ROOT)} imports {imp.target}" for imp in imports
               if imp.target.startswith("omnibus") and imp.target not in GRAPH.modules]
    assert not unknown, "imports of no module of the distribution:\n  " + "\n  ".join(unknown)


def test_no_module_imports_by_a_name_computed_at_run_time():
    # what importlib.import_module or __import__ loads is invisible to the rules here
    calls = []
    for path in GRAPH.modules.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__"):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not calls, f"imports by a computed name, which the rules cannot see: {calls}"


def test_the_torch_family_is_outside_the_base_install():
    # the rules below rely on it: "only the base install's dependencies" means "no torch"
    assert {"grpc", "google", "structlog", "tokenizers"} <= GRAPH.base_names
    assert not {"torch", "triton", "safetensors", "numpy", "transformers"} & GRAPH.base_names


def test_router_imports_no_engine_kernels_or_torch():
    torch_side = within("omnibus.engine", "omnibus.kernels", "omnibus.bench")
    check("the router imports the engine, the kernels, the benchmarks or beyond the base install",
          within("omnibus.router"), lambda t: torch_side(t) or beyond_base(t))


def test_engine_imports_no_router():
    check("the engine imports the router or the benchmarks",
          within("omnibus.engine"), within("omnibus.router", "omnibus.bench"))


def test_shared_rules_import_only_the_generated_code_and_base_dependencies():
    check("the shared rules import more than omnibus.v1 and the base install",
          within("omnibus.common"),
          lambda t: other_omnibus("omnibus.common", "omnibus.v1")(t) or beyond_base(t))


def test_generated_code_imports_only_itself_and_grpc():
    check("the generated code imports more than itself, grpc and protobuf",
          within("omnibus.v1"),
          lambda t: other_omnibus("omnibus.v1")(t)
          or (not t.startswith("omnibus") and t not in ("grpc", "google")))


def test_kernels_import_no_other_omnibus_package():
    check("the kernels import another omnibus package", within("omnibus.kernels"),
          other_omnibus("omnibus.kernels"))


def test_only_the_benchmarks_import_the_benchmarks():
    check("a module outside omnibus.bench imports it",
          lambda m: not within("omnibus.bench")(m), within("omnibus.bench"))


def test_engine_core_is_torch_free():
    allowed = ("omnibus.engine.core", "omnibus.common", "omnibus.v1")
    check("engine core loads more than itself, the shared rules and the base install at run "
          "time (an import for annotations alone goes under `if TYPE_CHECKING:`)",
          within("omnibus.engine.core"),
          lambda t: (other_omnibus(*allowed)(t) and t != "omnibus.engine") or beyond_base(t),
          type_checking=False)


# The engine's layers, lowest first: at run time a module imports its own layer and the
# ones below, never one above (an annotation may name any, under `if TYPE_CHECKING:`). An
# entry names a package's modules too, unless one of them has an entry of its own. Two
# modules sit below their folder's layer: the configuration holds SpecConfig, so
# spec/proposer.py (torch-free, the scheduler's side of speculation) sits under it, and
# the adapters stage their host copies with worker/transfer.py. Tensor parallelism's group
# and shard plan are the model's (its layers reduce over them); its ranks run model runners
# and serve their shard of moving KV (kv_transfer/shards.py, its transport and the plan for
# reading a handle of another rank count, reshard.py: below the connector that decides for them).
ENGINE_LAYERS = (
    # torch-free
    ("omnibus.engine", "omnibus.engine.core"),  # the scheduler, the KV block allocator
    ("omnibus.engine.request", "omnibus.engine.spec.proposer", "omnibus.engine.kv_transfer.handle"),
    ("omnibus.engine.config",),  # torch for annotations only
    # torch
    ("omnibus.engine.model", "omnibus.engine.worker.transfer", "omnibus.engine.parallel.group",
     "omnibus.engine.parallel.shard", "omnibus.engine.kv_transfer.shards", "omnibus.engine.kv_transfer.reshard",
     "omnibus.engine.kv_transfer.transport"),
    ("omnibus.engine.lora",),
    ("omnibus.engine.worker", "omnibus.engine.parallel"),  # the model runner, sampling, CUDA graphs; TP ranks
    ("omnibus.engine.kv_transfer",),  # the KV connector and its transfer engine (the pool's memory)
    ("omnibus.engine.spec",),  # the draft proposer runs a model runner
    ("omnibus.engine.engine",),  # the step loop
    ("omnibus.engine.serving", "omnibus.engine.__main__"),  # the gRPC service, the process
)


def engine_layer(module: str) -> int | None:
    """The index in ENGINE_LAYERS of `module`'s most specific entry; None outside the engine.
    `omnibus.engine` names its __init__ alone."""
    found = [(len(name), i) for i, names in enumerate(ENGINE_LAYERS) for name in names
             if module == name or (module.startswith(name + ".") and name != "omnibus.engine")]
    return max(found)[1] if found else None


def test_every_engine_module_has_a_layer():
    engine = [m for m in GRAPH.modules if within("omnibus.engine")(m)]
    assert [m for m in engine if engine_layer(m) is None] == []
    assert [name for names in ENGINE_LAYERS for name in names if name not in GRAPH.modules] == []


@pytest.mark.parametrize("layer", range(len(ENGINE_LAYERS)), ids=lambda i: ENGINE_LAYERS[i][-1])
def test_nothing_in_the_engine_imports_upward(layer: int):
    def above(target: str) -> bool:
        found = engine_layer(target)
        return found is not None and found > layer

    check(f"{' / '.join(ENGINE_LAYERS[layer])} imports a higher engine layer at run time (see "
          "ENGINE_LAYERS; an import for annotations alone goes under `if TYPE_CHECKING:`)",
          lambda m: engine_layer(m) == layer, above, chain=False, type_checking=False)


def test_a_violation_names_the_file_line_and_the_chain(tmp_path: Path):
    """The checker on a small tree: an import inside a function counts, one under
    TYPE_CHECKING only where asked, a chain through other modules too."""
    files = {
        "top/__init__.py": "",
        "top/a.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import torch\n"
                    "from . import b\n",
        "top/b.py": "import os\n\n\ndef f():\n    from top.c import g\n",
        "top/c.py": "try:\n    import torch.nn\nexcept ImportError:\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    setuptools = {"packages": ["top"], "package-dir": {"top": "top"}}
    graph = Graph(tmp_path, {"project": {"dependencies": []}, "tool": {"setuptools": setuptools}})
    torch = lambda t: t == "torch"  # noqa: E731
    chained = ("top/c.py:2 imports torch, loaded by top.a: "
               "top/a.py:5 imports top.b > top/b.py:5 imports top.c")
    assert graph.violations(lambda m: m == "top.a", torch, type_checking=False) == [chained]
    assert graph.violations(lambda m: m == "top.a", torch) == ["top/a.py:4 imports torch", chained]
    direct = graph.violations(lambda m: m == "top.a", torch, chain=False)
    assert direct == ["top/a.py:4 imports torch"]
    # each import once, by its shortest chain
    assert graph.violations(lambda m: m != "top.c", torch, type_checking=False) == [
        "top/c.py:2 imports torch, loaded by top.b: top/b.py:5 imports top.c"
    ]
    everywhere = graph.violations(lambda m: True, torch, type_checking=False)
    assert everywhere == ["top/c.py:2 imports torch"]


# ---- the source layout: import names and file paths agree ----------------------------------

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_ROOTS = [ROOT / r for r in PYPROJECT["tool"]["pytest"]["ini_options"]["pythonpath"]]


def by_path(module: str) -> list[Path]:
    """The files a path-based tool finds for `module` under the source roots."""
    rel = Path(*module.split("."))
    return [f for root in SOURCE_ROOTS
            for f in (root / rel.with_suffix(".py"), root / rel / "__init__.py") if f.is_file()]


def test_every_tool_reads_the_same_source_roots():
    # pytest's pythonpath, mypy's mypy_path and pyright's extraPaths name the same roots
    tools = PYPROJECT["tool"]
    assert tools["mypy"]["mypy_path"].split(":") == tools["pytest"]["ini_options"]["pythonpath"]
    assert tools["pyright"]["extraPaths"] == tools["pytest"]["ini_options"]["pythonpath"]


def test_every_module_lives_at_the_path_its_name_says():
    misplaced = [f"{name}: {path.relative_to(ROOT)}" for name, path in GRAPH.modules.items()
                 if by_path(name) != [path]]
    assert not misplaced, "modules whose path under the roots is not their name:\n  " + \
        "\n  ".join(misplaced)


def test_omnibus_is_a_namespace_and_no_top_level_folder_a_package():
    # a regular omnibus/__init__.py in one root would hide the other roots' parts, and a
    # top-level package (engine/__init__.py) would let its files load under a second name
    inits = [root / "omnibus" / "__init__.py" for root in SOURCE_ROOTS] + [
        root / "__init__.py" for root in SOURCE_ROOTS]
    assert not [str(i.relative_to(ROOT)) for i in inits if i.exists()]


def _omnibus_imports(path: Path) -> Iterable[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("omnibus."))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("omnibus"):
            # `from omnibus.x import y`: y is a module or a name in omnibus.x; x must resolve
            yield node.lineno, node.module if node.module != "omnibus" else f"omnibus.{node.names[0].name}"


def test_every_omnibus_import_in_the_tree_resolves_by_path_to_one_file():
    files = [p for folder in [*SOURCE_ROOTS, ROOT / "tests", ROOT / "scripts"]
             for p in folder.rglob("*.py") if "__pycache__" not in p.parts]
    unresolved = [f"{path.relative_to(ROOT)}:{line} imports {name} ({len(by_path(name))} files)"
                  for path in files for line, name in _omnibus_imports(path)
                  if len(by_path(name)) != 1]
    assert len(files) > 200 and not unresolved, "\n  ".join(unresolved)


def test_no_file_loads_under_two_names():
    # every module of the distribution imported in one interpreter started at the repository
    # root (so the root is on sys.path, as for `python -m` there): each file has one name,
    # and none is importable by its name without `omnibus.` (as `engine.engine` was)
    names = sorted(m for m in GRAPH.modules
                   if not m.startswith("omnibus.bench") and not m.endswith("__main__"))
    roots = [str(r) for r in SOURCE_ROOTS]
    code = (f"import importlib, sys\nsys.path[1:1] = {roots!r}\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            "files = {}\n"
            "for name, mod in list(sys.modules.items()):\n"
            "    f = getattr(mod, '__file__', None)\n"
            f"    if f and f.startswith({tuple(roots)!r}): files.setdefault(f, []).append(name)\n"
            "twice = [v for v in files.values() if len(v) > 1]\n"
            # the names a file had before the source roots: engine.core.scheduler for
            # omnibus.engine.core.scheduler, from the repository root
            "import importlib.util as u\n"
            "short = [m.split('.', 1)[1] for m in sys.modules if m.startswith('omnibus.')]\n"
            "def found(n):\n"
            "    try: spec = u.find_spec(n)\n"
            "    except ModuleNotFoundError: return False  # its parent is no package\n"
            "    return spec is not None and spec.origin is not None  # a file, not a namespace\n"
            "print(twice + [n for n in short if found(n)])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


BENCH_HELPERS = {"omnibus.bench.processes", "omnibus.bench.shapes"}  # what benchmarks and tests share


def test_no_test_but_the_benchmarks_own_imports_a_benchmark():
    """Tests outside tests/bench (and the bench CLI's test) use the shared helpers only,
    never a benchmark's module: a benchmark can change without breaking a test of the
    system."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/bench/") or rel == "tests/unit/test_cli_tools.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for module, name in re.findall(r"(?:from|import) (omnibus\.bench(?:\.\w+)?)(?: import (\w+))?", line):
                module = f"{module}.{name}" if module == "omnibus.bench" and name else module
                if module not in BENCH_HELPERS:
                    found.append(f"{rel}:{n} imports {module}")
    assert found == []
