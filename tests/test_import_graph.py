"""The package's layering (DESIGN.md "Package layout"), read from the source with `ast`.

Every import statement of every module under pagellm/ counts: module level, inside
functions, under TYPE_CHECKING. A rule is one row of LAYER_RULES (who may not import
what) or of ACYCLIC_PAIRS (two top-level subpackages that must not reach each other both
ways); adding a rule is adding a row. core/'s torch-free import is also checked by
running it (tests/core/test_no_torch.py).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "pagellm"


@dataclass(frozen=True)
class LayerRule:
    why: str
    importers: str  # modules under this dotted prefix...
    forbidden: tuple[str, ...]  # ...import nothing under these prefixes...
    exempt: tuple[str, ...] = ()  # ...except these importers: a module, or "package.*"


def _stages_except(*allowed: str) -> tuple[str, ...]:
    """Every top-level module and subpackage of pagellm but `allowed` (the stages)."""
    names = {p.stem for p in PACKAGE_ROOT.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in PACKAGE_ROOT.iterdir() if (p / "__init__.py").exists()}
    return tuple(f"pagellm.{name}" for name in sorted(names - set(allowed)))


LAYER_RULES = [
    LayerRule("metrics/ is fed by the engine and never imports it", "pagellm.metrics",
              ("pagellm.engine", "pagellm.entrypoints")),
    # pagellm/__init__.py re-exports LLM lazily: the public API, not a dependency.
    LayerRule("nothing outside entrypoints/ imports entrypoints/", "pagellm", ("pagellm.entrypoints",),
              exempt=("pagellm.entrypoints.*", "pagellm")),
    LayerRule("attention/backend.py is the interface only (selector.py picks a backend)",
              "pagellm.attention.backend",
              ("pagellm.attention.torch_backend", "pagellm.attention.cpu_backend",
               "pagellm.attention.triton_backend", "pagellm.attention.triton_kernels",
               "pagellm.attention.selector", "pagellm.kernels")),
    LayerRule("core/ is pure Python", "pagellm.core", ("torch", "triton", "numpy")),
    LayerRule("config/ decides settings from numbers: no torch and no other stage", "pagellm.config",
              ("torch", "triton", "numpy", *_stages_except("config", "errors"))),
]  # fmt: skip

# Top-level subpackages that may depend on each other one way at most.
ACYCLIC_PAIRS = [
    ("pagellm.bench", "pagellm.sim"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module that `source` (the text of `module`) imports. For `from a import b`
    both a and a.b count, since b may be a submodule (rules match prefixes, so a name that
    is not a module matches nothing)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    return {
        module_name(path): frozenset(
            imports_in(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
        )
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(rule: LayerRule, graph: dict[str, frozenset[str]]) -> list[str]:
    found = []
    for importer, targets in graph.items():
        if not under(importer, rule.importers):
            continue
        if any(under(importer, e[:-2]) if e.endswith(".*") else importer == e for e in rule.exempt):
            continue
        for target in sorted(targets):
            if any(under(target, f) for f in rule.forbidden):
                found.append(f"{importer} imports {target}")
    return found


def subpackage_edges(graph: dict[str, frozenset[str]]) -> dict[str, set[str]]:
    """Top-level subpackage -> the other top-level subpackages its modules import."""

    def top(name: str) -> str | None:
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "pagellm" and len(parts) > 1 else None

    packages = {top(m) for m in graph if top(m) and (PACKAGE_ROOT / top(m).split(".")[1]).is_dir()}
    edges: dict[str, set[str]] = {p: set() for p in packages}
    for importer, targets in graph.items():
        source = top(importer)
        if source not in edges:
            continue
        for target in targets:
            dest = top(target)
            if dest in packages and dest != source:
                edges[source].add(dest)
    return edges


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of subpackage imports from start to goal, or None."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(edges.get(node, ())):
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                if nxt == goal:
                    return paths[nxt]
                todo.append(nxt)
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert len(graph) > 50
    # Imports inside functions count like module-level ones.
    assert "pagellm.attention.triton_backend" in graph["pagellm.attention.selector"]
    assert "pagellm.sim.real_run" in graph["pagellm.bench.knob_sweep"]  # inside a function


@pytest.mark.parametrize("rule", LAYER_RULES, ids=lambda r: r.why)
def test_layer_rule(rule: LayerRule):
    graph = import_graph()
    assert any(under(m, rule.importers) for m in graph), f"no module under {rule.importers}"
    assert violations(rule, graph) == [], rule.why


@pytest.mark.parametrize("pair", ACYCLIC_PAIRS, ids=lambda p: " <-> ".join(p))
def test_no_cycle_between(pair: tuple[str, str]):
    edges = subpackage_edges(import_graph())
    a, b = pair
    assert a in edges and b in edges
    there, back = reaches(edges, a, b), reaches(edges, b, a)
    assert there is None or back is None, f"cycle: {' -> '.join(there)} and {' -> '.join(back)}"


def test_rules_catch_a_violation():
    """The checks themselves: crafted sources and graphs break each kind of rule."""
    source = "import os\nfrom . import sibling\ndef f():\n    from ..sim import real_run\n"
    assert imports_in(source, "pagellm.bench.x") == {
        "os", "pagellm.bench", "pagellm.bench.sibling", "pagellm.sim", "pagellm.sim.real_run"
    }
    graph = {
        "pagellm.metrics.x": frozenset({"pagellm.engine.llm_engine"}),
        "pagellm.sim.y": frozenset({"pagellm.entrypoints.cli_args", "pagellm.bench.z"}),
        "pagellm.bench.z": frozenset({"pagellm.sim.y"}),
        "pagellm": frozenset({"pagellm.entrypoints.llm"}),
        "pagellm.entrypoints.cli": frozenset({"pagellm.entrypoints.llm"}),
    }
    assert violations(LAYER_RULES[0], graph) == ["pagellm.metrics.x imports pagellm.engine.llm_engine"]
    assert violations(LAYER_RULES[1], graph) == ["pagellm.sim.y imports pagellm.entrypoints.cli_args"]
    edges = {"pagellm.bench": {"pagellm.sim"}, "pagellm.sim": {"pagellm.engine"}, "pagellm.engine": {"pagellm.bench"}}
    assert reaches(edges, "pagellm.sim", "pagellm.bench") == ["pagellm.sim", "pagellm.engine", "pagellm.bench"]
    assert reaches({"pagellm.bench": {"pagellm.sim"}}, "pagellm.sim", "pagellm.bench") is None
