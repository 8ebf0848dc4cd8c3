"""The package's map, checked: every import points down the layers of DESIGN.md, no
file of the package passes 600 lines, and sgl/ keeps few top-level modules.

Imports are read with ast from every module (top-level and inside functions, where
the lazy imports live), so a forbidden import fails here before it ever runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the package it installs as (pyproject's package-dir mapping).
FOLDERS = {"sgl": "sgl", "transports": "sgl.transports", "sched": "sgl.sched", "cache": "sgl.cache",
           "kernels": "sgl.kernels"}

# Bottom to top. A module may import its own room and any room of a lower rank; rooms
# of the same rank never import each other. The most specific prefix names a room.
LAYERS: list[tuple[int, str]] = [
    (0, "sgl.core"),
    (1, "sgl.transports"), (1, "sgl.cache"), (1, "sgl.kernels"),
    (2, "sgl.sched.models"),
    (3, "sgl.sched.req"),
    (4, "sgl.sched.batch"),
    (5, "sgl.sched.runner"),
    (6, "sgl.sched"),
    (7, "sgl.runtime"),
    (8, "sgl.engine"),
    (9, "sgl.server"),
    (10, "sgl"),
    (11, "sgl.testing"),
]
MAX_LINES = 600  # a safety net against files that hold too much, not a target to fill up to
MAX_TOP_LEVEL_MODULES = 10


def room_of(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for rank, prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
            best = (rank, prefix)
    assert best is not None, module
    return best


def package_modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            if folder == "sgl" and rel and rel[0] in ("transports", "sched", "cache", "kernels"):
                continue  # not there: those live in their own top-level folders
            parts = [p for p in rel if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported sgl module) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "sgl"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "sgl":
                continue
            # `from sgl.x import y` may name a submodule y: count the deepest module it names.
            for a in node.names:
                found.append((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base))
    return found


MODULES = package_modules()


def upward_imports() -> list[str]:
    bad = []
    for module, path in sorted(MODULES.items()):
        rank, room = room_of(module)
        for line, target in imports_of(path, module):
            t_rank, t_room = room_of(target)
            if t_room == room or t_rank < rank:
                continue
            if module == "sgl" and t_rank <= rank:
                continue  # the public face re-exports from every room
            where = "a room beside it" if t_rank == rank else "a room above it"
            bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target} ({where}: {t_room})")
    return bad


def test_every_import_points_down() -> None:
    bad = upward_imports()
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk catches what it must: a planted upward import in a lower room."""
    src = tmp_path / "planted.py"
    src.write_text("def f():\n    from sgl.runtime.tokenizer_manager import TokenizerManager\n")
    [(line, target)] = imports_of(src, "sgl.cache.planted")
    assert line == 2 and room_of(target)[0] > room_of("sgl.cache.planted")[0]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_over_the_line_limit(module: str) -> None:
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {n} lines: split it by what it holds"


def test_sgl_has_few_top_level_modules() -> None:
    top = [p.name for p in (ROOT / "sgl").glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)
