"""The layering contract, read off the source: every import of a scaletrain module (at module
level or inside a function) goes to its own layer or one below, never up, and no two modules
import each other, directly or around a loop. ``make lint`` runs this file too.

    cli -> analysis -> launch (and worker) -> trainer (and lifecycle) -> strategies
        -> {data, compression, fault, metrics, models, task, runtime, net, netns}
        -> {config, io, registry, env}

A new top-level module or package must be placed in LAYERS, or this test fails.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "scaletrain"

# Top to bottom. "scaletrain" is the package's own __init__ (the public API: RunConfig, Task,
# run); "__version__" the one constant modules take from it.
LAYERS: list[set[str]] = [
    {"scaletrain", "__main__", "cli"},
    {"analysis"},
    {"launch", "worker"},
    {"trainer", "lifecycle", "checkpointing"},
    {"strategies"},
    {
        "data",
        "compression",
        "fault",
        "metrics",
        "models",
        "task",
        "runtime",
        "net",
        "netns",
        "schedule",
    },
    {"config", "io", "registry", "env", "__version__"},
]
LAYER = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = ("scaletrain", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def unit(module: str) -> str:
    """The top-level module or package a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "scaletrain"


def type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: annotations only, never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(module: str) -> set[str]:
    """The scaletrain modules ``module`` imports when it runs."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", 0) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("scaletrain")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1],
                                 *([base] if base else [])])  # fmt: skip
            if not base.startswith("scaletrain"):
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                if name in MODULES:
                    out.add(name)
                elif base == "scaletrain" and alias.name == "__version__":
                    out.add("scaletrain.__version__")
                else:
                    out.add(base)
    return out - {module}


GRAPH = {m: imports(m) for m in MODULES}


def layer_of(module: str) -> int:
    if module == "scaletrain.__version__":
        return LAYER["__version__"]
    return LAYER[unit(module)]


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph.items()
        for b in sorted(targets)
        if layer_of(b) < layer_of(a)
    ]


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Import loops between modules, and pairs of top-level units that import each other."""
    found = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    found.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt in graph:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    units = {(unit(a), unit(b)) for a, bs in graph.items() for b in bs if unit(a) != unit(b)}
    found += [f"{a} <-> {b}" for a, b in itertools.combinations(sorted(LAYER), 2)
              if (a, b) in units and (b, a) in units]  # fmt: skip
    return sorted(set(found))


def test_every_module_has_a_layer():
    unplaced = sorted({unit(m) for m in MODULES} - set(LAYER))
    assert not unplaced, f"place these in LAYERS (tests/unit/test_layers.py): {unplaced}"


def test_nothing_imports_upward():
    assert not upward(GRAPH), "\n".join(upward(GRAPH))


def test_no_import_cycles():
    """Between modules (fsdp.py and tensor.py once imported each other), and between the
    top-level units of one layer."""
    assert not cycles(GRAPH), "\n".join(cycles(GRAPH)[:10])


def test_the_checks_can_fail():
    """What they would report: a strategy importing the trainer, two modules in a loop."""
    assert upward({"scaletrain.strategies.ddp": {"scaletrain.trainer"}}) == [
        "scaletrain.strategies.ddp (layer 4) imports scaletrain.trainer (layer 3)"
    ]
    loop = {"scaletrain.strategies.fsdp": {"scaletrain.strategies.tensor"},
            "scaletrain.strategies.tensor": {"scaletrain.strategies.fsdp"}}  # fmt: skip
    assert (
        "scaletrain.strategies.fsdp -> scaletrain.strategies.tensor -> "
        "scaletrain.strategies.fsdp" in cycles(loop)
    )
    assert "data <-> fault" in cycles(
        {"scaletrain.data.a": {"scaletrain.fault.b"}, "scaletrain.fault.b": {"scaletrain.data.c"}}
    )
