"""The package's layers run one way: a module imports only its own layer or lower ones.

Reads the code (ast), runs nothing: every import counts, those inside functions too. The order
is the README's "How it is built"; a module that fits no layer fails here until it is given one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "treadle"

# lowest first; a module belongs to the first entry that is it or one of its packages
LAYERS: list[tuple[str, ...]] = [
    ("treadle.runtime",),  # the process's plumbing: errors, plugins, threads, caches
    ("treadle.protocol", "treadle.sandbox", "treadle.models", "treadle.tracking"),
    ("treadle.algorithms",),  # pure: below config, which picks losses and settings by name
    ("treadle.config",),
    ("treadle.data", "treadle.rewards"),
    ("treadle.engines",),
    ("treadle.controller",),
    ("treadle.serving",),  # the service: server, client, replicas, weight sync, endpoint
    ("treadle.agents",),  # loops over the service's client
    ("treadle.rollout",),  # the driver's rollout: agent loops over placed replicas
    ("treadle.workers",),
    ("treadle.trainers",),
    ("treadle.check", "treadle.api", "treadle.cli", "treadle.tasks", "treadle.__main__", "treadle"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names if n != "treadle"):
            return i
    assert module == "treadle", f"{module} is in no layer: add it to LAYERS"
    return len(LAYERS) - 1


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The treadle modules that ``module`` imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        for name in names:
            found = name
            while found and found not in known:
                found = found.rpartition(".")[0]
            if found.startswith("treadle") and found != module:
                out.add(found)
    return out


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = _layer(module)
    up = sorted(m for m in GRAPH[module] if _layer(m) > mine and not module.startswith(m + "."))
    assert not up, f"{module} (layer {mine}) imports a higher layer: {up}"


def test_no_two_modules_import_each_other():
    """No loop of imports between modules (a package's __init__ re-exporting is not one)."""
    edges = {
        m: {d for d in deps if MODULES[d].name != "__init__.py" and not m.startswith(d + ".")}
        for m, deps in GRAPH.items()
    }
    seen: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(edges[m]):
            assert seen.get(d) != 1, "import loop: " + " -> ".join([*path, m, d])
            if d not in seen:
                visit(d, [*path, m])
        seen[m] = 2

    for m in sorted(edges):
        if m not in seen:
            visit(m, [])
