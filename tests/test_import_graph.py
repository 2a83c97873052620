"""The package's layering (docs/architecture.md, "Packages"), read from the source with `ast`.

Every import statement of every module under pagellm/ counts: module level, inside
functions, under TYPE_CHECKING. A rule is one row of LAYER_RULES (who may not import
what) or of ACYCLIC_PAIRS (two top-level subpackages that must not reach each other both
ways); adding a rule is adding a row. Below the subpackages, no two modules import each
other, no module imports another's private (_underscored) names, and no two C sources of
kernels/csrc call each other's functions. core/'s torch-free import is also checked by
running it (tests/core/test_no_torch.py).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "pagellm"
KERNEL_SOURCES = PACKAGE_ROOT / "kernels" / "csrc"


@dataclass(frozen=True)
class LayerRule:
    why: str
    importers: str  # modules under this dotted prefix...
    forbidden: tuple[str, ...]  # ...import nothing under these prefixes...
    exempt: tuple[str, ...] = ()  # ...except these importers: a module, or "package.*"...
    allowed: tuple[str, ...] = ()  # ...and except these targets (prefixes) under the forbidden ones


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
    LayerRule("engine/core.py is pure Python (the simulator steps through it)", "pagellm.engine.core",
              ("torch", "triton", "numpy", "pagellm"), allowed=("pagellm.core", "pagellm.errors")),
    LayerRule("lora/request.py is pure Python (core/ imports it)", "pagellm.lora.request",
              ("torch", "triton", "numpy", "pagellm"), allowed=("pagellm.errors",)),
    LayerRule("model/checkpoint/ reads a checkpoint's metadata without torch or the model classes",
              "pagellm.model.checkpoint", ("torch", "triton", "pagellm"),
              allowed=("pagellm.model.checkpoint", "pagellm.config", "pagellm.errors", "pagellm.tokenizer")),
    LayerRule("config/ decides settings from numbers: no torch and no other stage", "pagellm.config",
              ("torch", "triton", "numpy", "pagellm"), allowed=("pagellm.config", "pagellm.errors")),
    # The forward paths that call the native layers read the model and the attention
    # metadata: they live in model/native/, above kernels/.
    LayerRule("kernels/ is a leaf: it imports nothing of pagellm but kernels/ and errors.py", "pagellm.kernels",
              ("pagellm",), allowed=("pagellm.kernels", "pagellm.errors")),
    # The model computes, the worker decides how a step runs: a family module knows neither
    # the native CPU forwards (which read the model) nor the worker's step paths. The
    # loader runs the one after-load pass (model/native/after_load.py).
    LayerRule("family modules import neither model/native/ nor worker/", "pagellm.model",
              ("pagellm.model.native", "pagellm.worker"), exempt=("pagellm.model.native.*", "pagellm.model.loader.*")),
    LayerRule("lora/ imports model/ one way: model/ imports nothing of lora/", "pagellm.model", ("pagellm.lora",)),
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


def import_statements(source: str, module: str, is_package: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """Each import of `source` (the text of `module`) as (the module named, the names taken
    from it): `import a.b` is ("a.b", ()), `from .c import d, e` in package a is ("a.c", ("d", "e"))."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.append((base, tuple(alias.name for alias in node.names if alias.name != "*")))
    return found


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module that `source` (the text of `module`) imports. For `from a import b`
    both a and a.b count, since b may be a submodule (rules match prefixes, so a name that
    is not a module matches nothing)."""
    found: set[str] = set()
    for base, names in import_statements(source, module, is_package):
        found.add(base)
        found.update(f"{base}.{name}" for name in names)
    return found


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    return {
        module_name(path): frozenset(
            imports_in(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
        )
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }


@functools.cache
def module_graph() -> dict[str, frozenset[str]]:
    """Module -> the other modules of pagellm it imports (modules_imported)."""
    paths = {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        statements = import_statements(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        graph[module] = frozenset(modules_imported(statements, set(paths)) - {module})
    return graph


def modules_imported(statements: list[tuple[str, tuple[str, ...]]], modules: set[str]) -> set[str]:
    """The modules (of `modules`) that these imports load, exactly: `from a import b` is a.b
    where b is a submodule, else a. A package whose submodules alone are taken is not
    counted for its own sake: Python runs its __init__ first whichever way it is named."""
    found: set[str] = set()
    for base, names in statements:
        submodules = {f"{base}.{name}" for name in names} & modules
        found |= submodules
        if len(submodules) < len(names) or not names:
            found.add(base)
    return found & modules


def mutual_imports(graph: dict[str, frozenset[str]]) -> list[str]:
    """Every pair of modules that import each other, as "a <-> b"."""
    return sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


# A C function defined at the start of a line (not static), with its parameter list and body.
C_DEFINITION = re.compile(r"^(?!static\b|typedef\b)[A-Za-z_][\w \t*]*?\b(\w+)\s*\([^;{)]*\)\s*\{", re.MULTILINE)
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def c_call_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """C file -> the other files whose functions it calls (its text names them followed by
    "("). A function a file defines itself is its own, even where another build's source
    defines it too (linear_f32.c and quant_linear.c: one or the other is compiled in)."""
    texts = {name: C_COMMENT.sub(" ", text) for name, text in sources.items()}
    defined = {name: set(C_DEFINITION.findall(text)) for name, text in texts.items()}
    calls: dict[str, set[str]] = {name: set() for name in texts}
    for name, text in texts.items():
        called = set(re.findall(r"\b(\w+)\s*\(", text)) - defined[name]
        calls[name] = {other for other, functions in defined.items() if other != name and called & functions}
    return calls


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
            if any(under(target, f) for f in rule.forbidden) and not any(under(target, a) for a in rule.allowed):
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


def test_no_two_modules_import_each_other():
    graph = module_graph()
    assert "pagellm.kernels.cpu_features" in graph["pagellm.kernels.build"]  # `from pagellm.kernels import cpu_features`
    assert "pagellm.model.linear_plans" in graph["pagellm.model.llama"]  # under TYPE_CHECKING
    assert mutual_imports(graph) == [], "two modules import each other: move what both need below them"


def import_cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm,
    iterative): a set of modules each of which imports every other, through the rest."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycle_of_any_length():
    cycles = import_cycles(module_graph())
    assert cycles == [], "modules that import each other through others: move what they share below them"


def test_cycles_of_any_length_are_found():
    graph = {
        "a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}),  # a -> b -> c -> a
        "d": frozenset({"e"}), "e": frozenset({"d"}),  # a pair
        "f": frozenset({"a"}),  # reaches a cycle, is in none
    }  # fmt: skip
    assert import_cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert import_cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def private_imports(module: str, statements: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """`from x import _name` of another module's private names, as "module imports x._name"."""
    return [
        f"{module} imports {base}.{name}"
        for base, names in statements
        for name in names
        if name.startswith("_") and not name.startswith("__") and base != module
    ]


def test_no_module_imports_private_names_of_another():
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = module_name(path)
        found += private_imports(module, import_statements(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"))
    assert found == [], "a name another module needs is public: drop its underscore"


def test_no_two_kernel_sources_call_each_other():
    """csrc/kernels.h declares what one source calls in another; the calls go one way
    (linear.c's entry points above quant_linear.c above linear_bf16.c, for instance)."""
    calls = c_call_graph({path.name: path.read_text(encoding="utf-8") for path in sorted(KERNEL_SOURCES.glob("*.c"))})
    assert {"quant_linear.c", "linear_f32.c"} <= calls["linear.c"]  # the checks see real calls
    cycles = sorted(f"{a} <-> {b}" for a, targets in calls.items() for b in targets if a < b and a in calls[b])
    assert cycles == [], "two C sources call each other: put the entry point above both"


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
    kernels_leaf = next(rule for rule in LAYER_RULES if rule.importers == "pagellm.kernels")
    kernel_imports = {"pagellm.kernels.x": frozenset({"pagellm.kernels.build", "pagellm.errors", "pagellm.attention.backend"})}
    assert violations(kernels_leaf, kernel_imports) == ["pagellm.kernels.x imports pagellm.attention.backend"]
    edges = {"pagellm.bench": {"pagellm.sim"}, "pagellm.sim": {"pagellm.engine"}, "pagellm.engine": {"pagellm.bench"}}
    assert reaches(edges, "pagellm.sim", "pagellm.bench") == ["pagellm.sim", "pagellm.engine", "pagellm.bench"]
    assert reaches({"pagellm.bench": {"pagellm.sim"}}, "pagellm.sim", "pagellm.bench") is None
    # Module pairs: a submodule taken from a package imports that submodule, not the package.
    modules = {"pagellm.k", "pagellm.k.a", "pagellm.k.b"}
    statements = import_statements("from pagellm.k import b\nif TYPE_CHECKING:\n    from .b import X\n", "pagellm.k.a")
    assert modules_imported(statements, modules) == {"pagellm.k.b"}
    assert modules_imported([("pagellm.k", ("b", "NAME"))], modules) == {"pagellm.k", "pagellm.k.b"}
    pairs = {"pagellm.k.a": frozenset({"pagellm.k.b"}), "pagellm.k.b": frozenset({"pagellm.k.a"}), "pagellm.k": frozenset()}
    assert mutual_imports(pairs) == ["pagellm.k.a <-> pagellm.k.b"]
    assert private_imports("pagellm.k.a", [("pagellm.k.b", ("_ptr", "PUBLIC", "__version__"))]) == [
        "pagellm.k.a imports pagellm.k.b._ptr"
    ]
    c_sources = {
        "top.c": "/* calls part() */\nvoid entry(int n)\n{\n    part(n);\n}\n",
        "part.c": "static int helper(int n) { return n; }\nvoid part(int n) { helper(n); entry(n); }\n",
    }
    assert c_call_graph(c_sources) == {"top.c": {"part.c"}, "part.c": {"top.c"}}
