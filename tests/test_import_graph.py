"""Dependencies point one way: no package imports the tests, no import cycles, the
plugin's parts stack in layers (building blocks, then config, proposer and patches, then
tools/, train/ and benchmarks/ above the plugin), and the benchmarks use nothing of
`train/` but its prompt sets.

The graph is read from the source (every `import`, at module level or inside a
function), over the project's folders: vllm_carryover/, and kernels/, train/ and
benchmarks/, which install as vllm_carryover.kernels, .train and .benchmarks.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGIN = "vllm_carryover"
TOOL_FOLDERS = ("kernels", "train", "benchmarks")  # setup.py's package-directory mapping
PACKAGES = (PLUGIN, *TOOL_FOLDERS)
TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("*.py")} - {"__init__"} | {"support"}
KERNELS, TRAIN, BENCHMARKS = (f"{PLUGIN}.{folder}" for folder in TOOL_FOLDERS)
TOOLS = f"{PLUGIN}.tools"
# The plugin's building blocks: what the config, the proposer and the patches are made
# of. They import one another and nothing above them.
BLOCKS = tuple(f"{PLUGIN}.{part}" for part in (
    "drafter", "lookups", "control", "kernels", "slot", "slot_table", "length_limit",
    "metrics", "draft_trace", "errors", "dtype"))


def module_name(path: Path) -> str:
    """The installed name of a source file: kernels/x.py is vllm_carryover.kernels.x."""
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((PLUGIN, *parts) if parts[0] in TOOL_FOLDERS else parts)


def source_path(module: str) -> Path:
    """Where an installed name's source lives (the inverse of module_name), without suffix."""
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == PLUGIN and parts[1] in TOOL_FOLDERS:
        parts = parts[1:]
    return REPO.joinpath(*parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names a module imports: `from a.b import c` counts as the module a.b.c
    if there is one, else as a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (source_path(sub).with_suffix(".py").is_file()
                             or (source_path(sub) / "__init__.py").is_file())
                out.add(sub if is_module else node.module)
    return out


def project_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {m: {i for i in imports_of(p) if i in modules and i != m}
            for m, p in modules.items()}


def test_no_package_imports_the_tests() -> None:
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            names = imports_of(path)
            assert not {n.split(".")[0] for n in names} & (TEST_MODULES | {"tests"}), path
            assert not [line for line in path.read_text().splitlines()
                        if "sys.path" in line and "tests" in line], f"{path} reaches into tests/"


def test_there_are_no_import_cycles() -> None:
    graph = project_graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join([*stack[stack.index(n):], n])
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# What the benchmarks may use of train/: the held-out prompts (its public face).
# Everything else they share with train/ lives in vllm_carryover/.
BENCHMARKS_MAY_USE_OF_TRAIN = {f"{TRAIN}.prompts"}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_benchmarks_use_only_the_prompt_sets_of_train() -> None:
    graph = project_graph()
    for module, imports in graph.items():
        if within(module, BENCHMARKS):
            of_train = {i for i in imports if within(i, TRAIN)}
            assert of_train <= BENCHMARKS_MAY_USE_OF_TRAIN, (module, of_train)


def test_the_plugin_imports_neither_train_nor_benchmarks() -> None:
    graph = project_graph()
    for module, imports in graph.items():
        if not (within(module, TRAIN) or within(module, BENCHMARKS)):
            assert not {i for i in imports if within(i, TRAIN) or within(i, BENCHMARKS)}, module


def test_the_plugin_core_imports_no_tools() -> None:
    """tools/ (demo, testbed, console, server and engine processes, the rows of `train
    eval` and the benchmarks) sits above the plugin: vLLM's processes never load it."""
    graph = project_graph()
    for module, imports in graph.items():
        if not any(within(module, top) for top in (TOOLS, TRAIN, BENCHMARKS)):
            assert not {i for i in imports if within(i, TOOLS)}, module


def test_the_building_blocks_import_nothing_above_them() -> None:
    graph = project_graph()
    blocks = [m for m in graph if any(within(m, b) for b in BLOCKS)]
    assert blocks
    for module in blocks:
        above = {i for i in graph[module]
                 if not any(within(i, b) for b in BLOCKS) and within(i, PLUGIN)}
        assert not above, (module, above)


def test_only_the_plugin_entry_imports_the_patches() -> None:
    graph = project_graph()
    patches = f"{PLUGIN}.patches"
    for module, imports in graph.items():
        if not within(module, patches):
            assert not {i for i in imports if within(i, patches)} or module == PLUGIN, module
