"""The layering of attnlab, checked: which layer may import which, no cycles, no private imports.

The layers and the cycle rule are import-linter contracts in ``pyproject.toml``
(``[tool.importlinter]``); the two rules import-linter has no contract for (private names,
argparse) are checked here on the source's syntax trees. Each checker is also shown a planted
violation, so a checker that stopped seeing anything would fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "attnlab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[tuple[str, ast.Module, bool]]:
    """``(module name, syntax tree, is a package's __init__)`` of every module of attnlab."""
    return [
        (_module_name(p), ast.parse(p.read_text(encoding="utf-8"), str(p)), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute name of ``from <node.module> import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_imports(module: str, tree: ast.Module, is_package: bool = False) -> list[str]:
    """``module``'s uses of another attnlab module's private (``_name``) names: imported by name, or
    read as an attribute of an imported attnlab module."""
    found = []
    module_aliases: dict[str, str] = {}  # local name -> attnlab module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package)
            if not source.startswith("attnlab"):
                continue
            for alias in node.names:
                if source == module:
                    continue
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{module}: from {source} import {alias.name}")
                else:
                    module_aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attnlab") and alias.asname:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{module}: {module_aliases[node.value.id]}.{node.attr}")
    return found


def argparse_imports(module: str, tree: ast.Module) -> list[str]:
    names = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    ]
    return [f"{module} imports argparse" for n in names if n.split(".")[0] == "argparse"]


def test_import_linter_contracts_hold(monkeypatch):
    """The layers contract (cli > tools > training > library, ...) and the no-cycle contract."""
    lint = pytest.importorskip("importlinter.cli").lint_imports
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(PACKAGE.parent))
    assert lint(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0, "see the contract report above"


def test_no_module_imports_a_private_name_of_another():
    found = [f for m, tree, is_package in _sources() for f in private_imports(m, tree, is_package)]
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_only_the_command_line_parses_arguments():
    found = [f for m, tree, _ in _sources() if not m.startswith("attnlab.cli") for f in argparse_imports(m, tree)]
    assert not found, "\n".join(found)


def test_the_checkers_see_planted_violations():
    planted = ast.parse(
        "from attnlab.functional import _merge_masks\n"
        "from . import functional as fn\n"
        "import attnlab.model as m\n"
        "import argparse\n"
        "fn._reference(1)\n"
        "m._lm_loss\n"
        "fn.__name__\n"
    )
    found = private_imports("attnlab.attention", planted)
    assert sorted(found) == [
        "attnlab.attention: attnlab.functional._reference",
        "attnlab.attention: attnlab.model._lm_loss",
        "attnlab.attention: from attnlab.functional import _merge_masks",
    ], found
    assert argparse_imports("attnlab.tools.x", planted) == ["attnlab.tools.x imports argparse"]
