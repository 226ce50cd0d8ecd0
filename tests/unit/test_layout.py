"""The house rules: the README's Layout shows every room, tests mirror the rooms, modules and functions stay small."""

from __future__ import annotations

import ast
import re

from conftest import ROOT, TESTS

PACKAGE = ROOT / "open_sft"
GPU_CHECK = TESTS / "gpu_check"  # the GPU check's runner and probes: code too, held to the same sizes


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout\n"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def _rooms() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def test_readme_layout_names_every_room_and_top_level_module() -> None:
    block = _layout_block()
    missing = [f"{room}/" for room in _rooms() if not re.search(rf"^\s+{room}/", block, re.M)]
    missing += [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" and p.name not in block]
    assert not missing, f"README.md Layout lacks {missing}: add one line for each"


def test_unit_tests_mirror_the_rooms() -> None:
    folders = sorted(p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert set(folders) <= set(_rooms()), f"tests/unit/ folders without a room: {set(folders) - set(_rooms())}"


def test_no_module_over_400_lines_no_function_over_60() -> None:
    too_long = []
    for path in sorted([*PACKAGE.rglob("*.py"), *GPU_CHECK.rglob("*.py")]):
        source = path.read_text()
        if len(source.splitlines()) > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long, "split these: " + "; ".join(too_long)


def test_the_gpu_check_is_a_package_not_scripts_glued_by_sys_path() -> None:
    files = [*GPU_CHECK.rglob("*.py"), *(ROOT / "scripts").glob("gpu_check*.py")]
    glued = [str(p.relative_to(ROOT)) for p in files if "sys.path" in p.read_text()]
    assert not glued, f"{glued}: import the package (tests.gpu_check), don't edit sys.path"
