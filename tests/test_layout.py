"""The shape of the package (docs/architecture.md): no import circle, and no format named outside ``stfs/formats/``
(a format is one module there, listed in ``formats.REGISTRY``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from stfs import formats

PACKAGE = Path(__file__).resolve().parent.parent / "stfs"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    found |= {_module_name(path): path for path in PACKAGE.rglob("*.c")}  # the C extensions: stfs._native, ...
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that ``name`` imports, at its top, in a function or for type checking alone."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            named = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
            found |= named or ({target} & modules.keys())
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & modules.keys()
    return found - {name}


def test_the_package_has_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items() if path.suffix == ".py"}
    circles = []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(trail[trail.index(name) :] + [name])
            return
        if name in done:
            return
        for imported in sorted(graph.get(name, ())):
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert circles == []


def test_no_module_outside_formats_names_a_format() -> None:
    """No import, call or attribute of a format's module outside ``stfs/formats/``: the rest asks ``formats``."""
    names = "|".join(module for module, _, _ in formats.REGISTRY)
    imported = rf"\bformats\.({names})\b|\bformats import .*\b({names})\b|^\s*import ({names})\b"
    pattern = re.compile(rf"{imported}|(?<![.\w/-])({names})\.[A-Za-z_]")  # or an attribute of one: gguf.x
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "formats" in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if '"""' in code or code.strip().startswith(("``", '"', "'")):
                continue  # prose: a docstring may say what a format does
            if pattern.search(code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert offenders == []


def test_no_module_of_the_package_is_over_900_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 900
    }
    assert long == {}


def test_no_format_names_its_tensors_xattr_namespace() -> None:
    """A tensor's xattr namespace is the name of the format that read it (``formats.read_with``): a format module
    that sets ``namespace`` (a class attribute of its entries, say) would hide that and could name another."""
    offenders = []
    for path in (PACKAGE / "formats").rglob("*.py"):
        if path.name == "base.py" and path.parent == PACKAGE / "formats":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            names = [
                t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in targets
            ]
            keywords = [k.arg for k in node.keywords] if isinstance(node, ast.Call) else []
            if "namespace" in names or "namespace" in keywords:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == []


def test_errors_py_holds_no_format_s_rule_errors() -> None:
    """A format's rule errors live with the format (its module, or its package's ``rules.py``); ``stfs.errors`` keeps
    the bases and what every format shares (a ``RuleError`` there names no format)."""
    from stfs import errors

    named = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.RuleError) and value.format_name
    ]
    assert named == []
