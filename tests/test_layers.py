"""The package's import structure: imports run only downwards through the layers, and no
module imports itself back through others (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import vacpack

PACKAGE_DIR = Path(vacpack.__file__).parent

# Top to bottom; a module may import from its own package or from any layer below its own.
LAYERS: list[set[str]] = [
    {"vacpack.__main__"},
    {"vacpack.cli"},
    {"vacpack.ray"},  # Ray Serve wraps the server's app; Ray Data actors run LLM jobs
    {"vacpack.server", "vacpack.batch"},
    {"vacpack.openai_api"},
    {"vacpack.llm"},
    {"vacpack.corpus_jobs"},
    {"vacpack.tensor_parallel", "vacpack.beam_search"},
    {"vacpack.corpus"},
    {"vacpack.engine"},
    {"vacpack.runtime", "vacpack.testing", "vacpack.lora"},
    {"vacpack.models"},
    {"vacpack.attention"},
    {"vacpack.kvcache"},
    {"vacpack.structured"},  # grammars and token masks; their parameters are a leaf
    # The model's recommended sampling reads generation_config.json as the tokenizer module
    # names it.
    {
        "vacpack.detokenizer",
        "vacpack.sampling",
        "vacpack.device",
        "vacpack.generation_defaults",
        "vacpack.pooling_params",
    },
    {"vacpack.tuning"},
    {
        "vacpack.cpu_kernels",
        "vacpack.config",
        "vacpack.outputs",
        "vacpack.tokenizer",
        "vacpack.host_memory",
        "vacpack.python_heap",
        "vacpack.chat_turns",
        "vacpack.inputs",
        "vacpack.huge_pages",
        "vacpack.pinned_staging",
        "vacpack.registry",
        "vacpack.distributed",
        "vacpack.output_file",
        "vacpack.structured.params",
    },
    # A request's adapter, named in RequestOutput (vLLM's field) as anywhere above.
    {"vacpack.errors", "vacpack.lora.request"},
]
# The package's __init__ (`from vacpack import LLM`) runs before any of its modules, whoever
# imports what: it is outside the layers.
FACADE = "vacpack"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    return {
        name: _imports(
            path.read_text(encoding="utf-8"), name, path.name == "__init__.py", set(paths)
        )
        for name, path in paths.items()
    }


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The vacpack modules a file imports at run time, wherever in the file the import is."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return  # annotations only: never imported at run time
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *base.split(".")]).strip(
                    "."
                )
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return {module for module in found if module in modules and module != name}


def _layer_of(module: str) -> int:
    """The layer of the longest LAYERS entry that is the module or a package holding it."""
    matches = [
        (len(top), index)
        for index, layer in enumerate(LAYERS)
        for top in layer
        if module == top or module.startswith(top + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def _top_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for name, targets in graph.items():
        if name == FACADE:
            continue
        for target in targets - {FACADE}:
            if _top_package(target) != _top_package(name) and _layer_of(target) <= _layer_of(name):
                upward.append(f"{name} (layer {_layer_of(name)}) imports {target}")
    return sorted(upward)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles = []
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_every_import_runs_downwards() -> None:
    upward = _upward_imports(_import_graph())
    assert not upward, "imports that do not run downwards:\n" + "\n".join(upward)


def test_no_module_imports_itself_back() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_checks_find_a_lazy_circle_and_an_upward_import() -> None:
    modules = {"vacpack.engine.a", "vacpack.engine.b", "vacpack.llm"}
    lazy = "def f():\n    from vacpack.engine.b import g\n"
    graph = {
        "vacpack.engine.a": _imports(lazy, "vacpack.engine.a", False, modules),
        "vacpack.engine.b": _imports("from . import a\n", "vacpack.engine.b", False, modules),
        "vacpack.llm": set(),
    }
    assert graph["vacpack.engine.a"] == {"vacpack.engine.b"}
    assert graph["vacpack.engine.b"] == {"vacpack.engine.a"}
    assert _cycles(graph) == ["vacpack.engine.a -> vacpack.engine.b -> vacpack.engine.a"]
    graph["vacpack.engine.b"] = {"vacpack.llm"}
    engine_layer = _layer_of("vacpack.engine.b")
    assert _upward_imports(graph) == [
        f"vacpack.engine.b (layer {engine_layer}) imports vacpack.llm"
    ]
