"""The core's layering, read from the source: which rooms may import which.

- the core imports no framework (numpy only);
- the transports import neither the algorithms nor the engine (no circle: the algorithms build
  on the transports, the engine on both);
- the engine and the algorithms reach shared memory and TCP only through ``Transport``;
- no module imports another module's private name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"
FRAMEWORKS = ("torch", "tensorflow", "keras", "tf_keras", "ray", "jax")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in ``path``."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            if not node.module:  # ``from . import x``: each name is a module
                out += [(node.lineno, f"{module}.{n}", []) for n in names]
            else:
                out.append((node.lineno, module, names))
    return out


def _files(room: str) -> list[Path]:
    return sorted((SRC / room).rglob("*.py"))


def _violations(room: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(SRC)}:{line} imports {mod}"
            for p in _files(room) for line, mod, _ in _imports(p)
            if any(mod == f or mod.startswith(f + ".") for f in forbidden)]


def test_the_core_imports_no_framework() -> None:
    assert _violations("core", FRAMEWORKS) == []


@pytest.mark.parametrize("room, forbidden", [
    ("core/transport", ("shoal.core.algorithms", "shoal.core.engine",
                        "shoal.core.communicator", "shoal.core.collectives")),
    ("core/algorithms", ("shoal.core.engine", "shoal.core.communicator",
                         "shoal.core.collectives", "shoal.core.transport.shm",
                         "shoal.core.transport.tcp")),
    ("core/engine", ("shoal.core.transport.shm", "shoal.core.transport.tcp",
                     "shoal.core.communicator", "shoal.core.collectives")),
])
def test_rooms_import_only_downward(room: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(room, forbidden) == []


def test_the_engine_and_the_algorithms_use_the_transport_door_only() -> None:
    """Neither reads a transport's shared-memory group or mesh directly, except the
    algorithms, whose work is to drive them (through the transport they are given)."""
    found = []
    for p in _files("core/engine"):
        text = p.read_text()
        for attr in (".shm.", ".mesh.", ".shm)", ".mesh)"):
            if attr in text:
                found.append(f"{p.relative_to(SRC)} reads {attr.strip('.)')}")
    assert found == []


def _exported(module: str) -> set[str]:
    """The names ``module`` lists in ``__all__`` (an API that happens to start with ``_``,
    as Horovod's ``_executing_eagerly``, is exported on purpose)."""
    base = SRC.parent.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.exists():
        return set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_no_module_imports_a_private_name_of_another() -> None:
    found = [f"{p.relative_to(SRC)}:{line} imports {mod}.{name}"
             for p in sorted(SRC.rglob("*.py")) for line, mod, names in _imports(p)
             if mod.startswith("shoal") for name in names
             if name.startswith("_") and not name.startswith("__")
             and name not in _exported(mod)]
    assert found == []


def test_process_state_lives_in_the_runtime_only() -> None:
    """The default communicator, the process sets and the elastic client are fields of
    ``shoal.core.runtime.RUNTIME``; the core's modules keep no module-level registry of them
    (a mutable container or a None-initialised module global)."""
    found = []
    for p in _files("core"):
        for node in ast.parse(p.read_text()).body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                else None)
            if not isinstance(target, ast.Name) or target.id.isupper() or \
                    target.id.startswith("__"):
                continue
            value = node.value
            if isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(value, ast.Constant) and value.value is None):
                found.append(f"{p.relative_to(SRC)}:{node.lineno} {target.id}")
    assert found == []
