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


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The open_sft modules one import statement reaches: `from X import Y` reaches X.Y when that is a module."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    reached = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return reached & modules


def _typing_only(tree: ast.AST) -> set[ast.AST]:
    """The imports under `if TYPE_CHECKING:`: for annotations, never run."""
    blocks = [node for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    return {inner for block in blocks for statement in block.body for inner in ast.walk(statement)}


def _import_graph() -> dict[str, set[str]]:
    """Every import of open_sft's modules that runs, at module level and inside functions alike."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        typing_only = _typing_only(tree)
        statements = [node for node in ast.walk(tree)
                      if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in typing_only]
        graph[module] = set().union(*(_imported(module, path.name == "__init__.py", node, set(paths))
                                      for node in statements)) - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    circles = _circles(_import_graph())
    assert not circles, "import circles (one concept in two rooms: give it its own module): " + \
        "; ".join("{" + ", ".join(circle) + "}" for circle in circles)


def test_the_gpu_check_is_a_package_not_scripts_glued_by_sys_path() -> None:
    files = [*GPU_CHECK.rglob("*.py"), *(ROOT / "scripts").glob("gpu_check*.py")]
    glued = [str(p.relative_to(ROOT)) for p in files if "sys.path" in p.read_text()]
    assert not glued, f"{glued}: import the package (tests.gpu_check), don't edit sys.path"
