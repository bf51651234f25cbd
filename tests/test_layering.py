"""Every import points down the layers, and no private name crosses a package.

The layers (README, "How it works"), bottom to top:

0. vocabulary: placements, reshard plans, plans, options, cluster specs, errors;
1. the model of a step: tracing and analysis, sharding rules and strategies, the cost model
   (``autopar.cost_model``: pure functions of the vocabulary and a ``ClusterSpec``, which imports
   nothing of the passes) and the cost tables built from it;
2. the solver: the ILP, the outer search over meshes, the pricing of the chosen solution;
3. codegen and the runtime: the rank-local module, its collectives, the launcher;
4. tools that measure the layers below by running them: calibration, the op profiler, the rule
   validator and its simulator, step measurement;
5. the API: ``autoparallelize``, ``plan``, the CLI, the report, the examples.

A module may import its own layer and those below, never above (imports inside
``if TYPE_CHECKING:`` included: a type that lives above is a design smell too). Checked on the
source with ``ast``, so an import that only runs on some path is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# top-level folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"autopar": "autopar", "passes": "autopar.passes", "cost_model": "autopar.cost_model",
            "codegen": "autopar.codegen", "kernels": "autopar.kernels"}  # fmt: skip

# module (or package prefix) -> layer; the longest matching prefix decides
LAYERS = {
    "autopar.errors": 0,
    "autopar.placement": 0,
    "autopar.reshard": 0,
    "autopar.plan": 0,
    "autopar.plan_axes": 0,
    "autopar.options": 0,
    "autopar.hardware": 0,
    "autopar.presets": 0,
    "autopar.cluster": 0,
    "autopar.model_spec": 0,
    "autopar.trades": 0,
    "autopar.fusion": 0,
    "autopar.lowerings": 1,  # read by the cost tables (1) and codegen (3); reads the rules and kernels
    "autopar.passes.trades": 2,
    "autopar.passes.trade_terms": 2,
    "autopar.passes.pipeline": 2,
    "autopar.passes": 1,
    "autopar.cost_model": 1,
    "autopar.passes.solver": 2,
    "autopar.passes.search": 2,
    "autopar.passes.search_problem": 2,
    "autopar.passes.candidates": 2,
    "autopar.passes.candidate_tables": 2,
    "autopar.passes.prefetch": 2,
    "autopar.passes.ladder": 2,
    "autopar.passes.rungs": 2,
    "autopar.passes.mesh_solve": 2,
    "autopar.passes.outcome": 2,
    "autopar.passes.no_fit": 2,
    "autopar.passes.dumps": 2,
    "autopar.passes.solved_plan": 2,
    "autopar.passes.price": 2,
    "autopar.passes.reprice": 2,
    "autopar.codegen": 3,
    "autopar.kernels": 1,  # the fused ops passes/fuse.py rewrites into: part of the op vocabulary
    "autopar.launch": 3,
    "autopar.tools": 4,
    "autopar": 5,
}
NAMES = ["vocabulary", "model (passes, cost model)", "solver", "codegen/runtime", "tools", "API"]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _package(module: str, is_pkg: bool) -> str:
    return module if is_pkg else module.rpartition(".")[0]


def _imports(module: str, path: Path):
    """(line, imported module, imported names) of every autopar import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = _package(module, path.name == "__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("autopar"):
                    yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("autopar"):
                yield node.lineno, base, tuple(a.name for a in node.names)


MODULES = _modules()


def test_the_layer_map_knows_every_module():
    assert "autopar.reshard" in MODULES and "autopar.codegen.lower" in MODULES
    for m in MODULES:
        layer(m)  # every module has a layer (the API's prefix catches the rest of autopar)


def test_every_import_points_down():
    wrong = []
    for module, path in MODULES.items():
        for line, target, names in _imports(module, path):
            # ``from autopar.x import y``: y may be a submodule
            candidates = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES] or [target]
            for t in candidates:
                if layer(t) > layer(module):
                    wrong.append(
                        f"{path.relative_to(ROOT)}:{line}: {module} ({NAMES[layer(module)]}) imports "
                        f"{t} ({NAMES[layer(t)]})"
                    )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_cost_model_imports_nothing_of_the_passes():
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"
        for module, path in MODULES.items()
        if module.startswith("autopar.cost_model")
        for line, target, _ in _imports(module, path)
        if target.startswith("autopar.passes")
    ]
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_package():
    """``from autopar.x import _name`` (or ``module._name``) from another package is refused: a
    name another package needs is public, with a docstring."""
    wrong = []
    for module, path in MODULES.items():
        pkg = _package(module, path.name == "__init__.py")
        aliases = {}
        for line, target, names in _imports(module, path):
            target_pkg = (
                target
                if (target in MODULES and MODULES[target].name == "__init__.py")
                else target.rpartition(".")[0]
            )
            for n in names:
                if f"{target}.{n}" in MODULES:  # a submodule: attribute uses are checked below
                    aliases[n] = f"{target}.{n}"
                elif n.startswith("_") and not n.startswith("__") and target_pkg != pkg:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports private {target}.{n}")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autopar"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and aliases[node.value.id].rpartition(".")[0] != pkg
            ):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {module} uses private "
                    f"{aliases[node.value.id]}.{node.attr}"
                )
    assert not wrong, "private names across packages:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "module, target, ok",
    [
        ("autopar.codegen.lower", "autopar.reshard", True),
        ("autopar.reshard", "autopar.codegen.lower", False),
        ("autopar.passes.search", "autopar.passes.costs", True),
        ("autopar.passes.costs", "autopar.passes.search", False),
        ("autopar.tools.calibrate", "autopar.launch", True),
        ("autopar.cost_model.comm", "autopar.tools.calibrate", False),
    ],
)
def test_the_check_itself_tells_down_from_up(module, target, ok):
    assert (layer(target) <= layer(module)) is ok


def test_no_two_modules_import_each_other():
    """Import cycles between modules (``overlap`` <-> ``calibrate`` once) tie two concepts into one:
    none, counting imports inside functions too."""
    import networkx as nx

    g = nx.DiGraph()
    for module, path in MODULES.items():
        for _, target, names in _imports(module, path):
            for t in [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES] or [target]:
                if t in MODULES and t != module and not module.startswith(t + "."):
                    g.add_edge(module, t)
    cycles = [c for c in nx.simple_cycles(g) if not all(m == "autopar" or m.endswith("__init__") for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:10])
