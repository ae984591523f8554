"""The layering contract, read off the source: every import of a scaletrain module (at module
level, inside a function, or under ``if TYPE_CHECKING:``, which hides a dependency from the
interpreter but not from a reader) goes to its own layer or one below, never up, and no two
modules, nor two top-level units, import each other, directly or around a loop of any
length. ``make lint`` runs this file too.

    cli -> analysis -> launch (and worker) -> trainer (and lifecycle) -> strategies
        -> {data, compression, fault, metrics, models, task, runtime, net, netns}
        -> {config, io, registry, env}

A new top-level module or package must be placed in LAYERS, or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "scaletrain"

# Top to bottom. "scaletrain" is the package's own __init__ (the public API: RunConfig, Task,
# run); "version" holds __version__, which any layer may read.
LAYERS: list[set[str]] = [
    {"scaletrain", "__main__", "cli"},
    {"analysis"},
    {"launch", "worker"},
    {"trainer", "lifecycle", "checkpointing", "loop"},
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
    {"config", "io", "registry", "env", "version"},
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


def imports(module: str) -> set[str]:
    """The scaletrain modules ``module`` imports, for running or for its annotations."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
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
                else:
                    out.add(base)
    return out - {module}


GRAPH = {m: imports(m) for m in MODULES}


def layer_of(module: str) -> int:
    return LAYER[unit(module)]


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph.items()
        for b in sorted(targets)
        if layer_of(b) < layer_of(a)
    ]


def loops(graph: dict[str, set[str]]) -> list[str]:
    """Every node that can reach itself, with one path that does ("a -> b -> a")."""
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
    return found


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Import loops between modules, and between top-level units (of any length: data ->
    fault -> metrics -> data is a loop of units though no module loops)."""
    units: dict[str, set[str]] = {}
    for a, bs in graph.items():
        units.setdefault(unit(a), set()).update(unit(b) for b in bs if unit(b) != unit(a))
    return sorted(set(loops(graph)) | {f"units: {c}" for c in loops(units)})


def test_the_graph_is_the_package():
    """Not vacuous: the modules were found where they are, with their imports."""
    assert len(MODULES) >= 80, sorted(MODULES)
    for name in (
        "scaletrain.cli",
        "scaletrain.trainer",
        "scaletrain.lifecycle",
        "scaletrain.launch.agent",
        "scaletrain.strategies.ddp",
        "scaletrain.config",
    ):
        assert name in MODULES, name  # fmt: skip
    assert "scaletrain.lifecycle" in GRAPH["scaletrain.trainer"]
    assert "scaletrain.strategies.base" in GRAPH["scaletrain.strategies.ddp"]
    assert sum(len(v) for v in GRAPH.values()) >= 200


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
    assert "units: data -> fault -> data" in cycles(
        {"scaletrain.data.a": {"scaletrain.fault.b"}, "scaletrain.fault.b": {"scaletrain.data.c"}}
    )
    three = {"scaletrain.data.a": {"scaletrain.fault.b"},
             "scaletrain.fault.b": {"scaletrain.metrics.c"},
             "scaletrain.metrics.c": {"scaletrain.data.d"}}  # fmt: skip
    assert "units: data -> fault -> metrics -> data" in cycles(three)


def test_an_annotation_only_import_counts(tmp_path, monkeypatch):
    """``if TYPE_CHECKING:`` imports are dependencies too (they once hid trainer <->
    lifecycle <-> checkpointing)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from scaletrain.trainer import Trainer\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "scaletrain.strategies.probe", path)
    assert imports("scaletrain.strategies.probe") == {"scaletrain.trainer"}


def test_summary_json_is_assembled_in_one_place():
    """Every mode's summary.json comes from metrics/summary.write_summary: no other module
    aggregates the totals (``summarize``) or writes the file itself."""
    import re

    writes = re.compile(r"(summarize\(|atomic_write_\w+\([^)]*\"summary\.json\")")
    writers = [
        name
        for name, path in MODULES.items()
        if name != "scaletrain.metrics.summary" and writes.search(path.read_text())
    ]
    assert writers == [], writers  # fmt: skip
