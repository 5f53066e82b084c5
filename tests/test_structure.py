"""The project's layout: a flat root (the reading path and the two commands), role folders that import one way, an
import graph (lazy imports included) that is a DAG, and library modules that import no CLI plumbing."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders, low to high: a module may import from its own folder and the ones before it, never from one after it.
FOLDERS = ("ops", "models", "formats", "features", "serving", "scripts")
# The root's modules by role. LIBRARY may import ops/formats/features; the commands also serving; none scripts.
LIBRARY = {"config", "model", "kvcache", "sample", "tokenizer", "quantize", "load", "step", "decode", "text",
           "speculative", "params"}
COMMANDS = {"generate", "serve"}  # what users type: `python generate.py`, `python serve.py`
CLI = {"cli"}  # what the commands (and scripts/) share: flags' checks, the default model, one error line
CARD = {"model", "tokenizer", "kvcache", "sample", "speculative", "quantize", "generate"}  # the project's own seven


def module_files() -> dict[str, str]:
    """Dotted module name -> path, for the root's modules and every folder's."""
    found = {}
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            found[name[:-3]] = os.path.join(ROOT, name)
    for folder in FOLDERS:
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py") and name != "__init__.py":
                found[f"{folder}.{name[:-3]}"] = os.path.join(ROOT, folder, name)
    return found


def imports(path: str, names: set[str]) -> set[str]:
    """The project modules a file imports anywhere, inside functions too: `import a.b`, `from a.b import c` and
    `from a import b` (b a module) all name the module they load."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found & names


def loaded_imports(path: str) -> set[str]:
    """Every module a file imports when it is loaded (the project's and others, e.g. `torch.nn`): its imports
    outside function bodies."""
    found = set()
    stack = list(ast.parse(open(path, encoding="utf-8").read()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        stack += ast.iter_child_nodes(node)
    return found


def folder_of(module: str) -> str | None:
    return module.split(".")[0] if "." in module else None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {m: imports(path, set(files)) - {m} for m, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path (its first module repeated at the end), or None for a DAG."""
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return None
        if state.get(m) == "active":
            return path[path.index(m):] + [m]
        state[m] = "active"
        for n in sorted(graph[m]):
            if (cycle := visit(n, path + [m])) is not None:
                return cycle
        state[m] = "done"
        return None

    for m in sorted(graph):
        if (cycle := visit(m, [])) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    """The DAG check can fail: a two-module cycle and a three-module one are found, a chain is not."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_is_a_dag(graph):
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_root_is_the_reading_path():
    """At most 16 modules at the root, the card's seven among them, each with a role here; the rest in folders."""
    root = {m for m in module_files() if "." not in m}
    assert len(root) <= 16 and CARD <= root, sorted(root)
    assert root == LIBRARY | COMMANDS | CLI, f"unclassified root modules: {sorted(root ^ (LIBRARY | COMMANDS | CLI))}"
    for folder in FOLDERS:
        assert os.path.exists(os.path.join(ROOT, folder, "__init__.py")), f"{folder}/ is not a package"


def test_folders_import_one_way(graph):
    """A folder's modules import only their own folder, earlier folders and the root; the root's library imports
    no serving or scripts module, the commands no scripts module."""
    rank = {folder: i for i, folder in enumerate(FOLDERS)}
    for m, used in graph.items():
        for n in used:
            src, dst = folder_of(m), folder_of(n)
            if dst is None:
                continue
            if src is not None:
                assert rank[dst] <= rank[src], f"{m} ({src}/) imports {n} ({dst}/, a later folder)"
            elif m in COMMANDS | CLI:
                assert dst != "scripts", f"{m}.py imports {n}"
            else:
                assert dst in ("ops", "models", "formats", "features"), f"{m}.py (library) imports {n} ({dst}/)"


def test_folder_direction_check_can_fail(graph):
    """The one-way rule catches a folder importing a later one, and the library importing serving."""
    bad = {**graph, "ops.gemv": graph["ops.gemv"] | {"serving.engine"}}
    with pytest.raises(AssertionError, match="a later folder"):
        test_folders_import_one_way(bad)
    bad = {**graph, "model": graph["model"] | {"serving.engine"}}
    with pytest.raises(AssertionError, match="library"):
        test_folders_import_one_way(bad)


def test_library_modules_import_no_cli_plumbing():
    files = module_files()
    entry_points = COMMANDS | {m for m in files if folder_of(m) == "scripts"}
    for name, path in files.items():
        if name in entry_points | CLI:
            continue
        used = imports(path, set(files) | {"argparse"})
        assert not used & (entry_points | CLI | {"argparse"}), f"{name} imports {used & (entry_points | CLI)}"
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.arg) and node.annotation is not None:
                assert "Namespace" not in ast.unparse(node.annotation), f"{name} takes an argparse Namespace"


# What loading the request parser must not load: the parser stays pure (requests in, engine Requests out), so a
# front end or a test can use it without torch, the model or the engine.
ENGINE_SIDE = {"model", "step", "kvcache", "sample", "serving.engine", "serving.choices", "serving.scheduler"}


def heavy_imports(loads: dict[str, set[str]], start: str) -> list[str]:
    """What loading `start` loads that it must not: ENGINE_SIDE modules, and modules that import torch when loaded.
    loads: module -> loaded_imports (project modules and others)."""
    reached, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += [n for n in loads[m] if n in loads]
    bad = sorted(reached & ENGINE_SIDE)
    bad += sorted(f"{m} (imports torch)" for m in reached if any(n.split(".")[0] == "torch" for n in loads[m]))
    return bad


@pytest.fixture(scope="module")
def loads() -> dict[str, set[str]]:
    return {m: loaded_imports(path) for m, path in module_files().items()}


def test_the_request_parser_loads_no_torch(loads):
    """serving.protocol (and answer.py, the contract) load neither torch, nor the model, nor the engine, even
    through what they import."""
    for start in ("serving.protocol", "serving.answer", "serving.contract", "serving.messages", "serving.responses"):
        assert heavy_imports(loads, start) == [], f"{start} loads {heavy_imports(loads, start)}"


def test_heavy_import_check_can_fail(loads, tmp_path):
    """The check sees torch and the engine two imports away, and an import at a module's top level (an `if` or a
    class body included) but not one inside a function."""
    bad = {**loads, "params": loads["params"] | {"sample"}}
    assert "sample" in heavy_imports(bad, "serving.protocol")
    assert "sample (imports torch)" in heavy_imports(bad, "serving.protocol")
    bad = {**loads, "text": loads["text"] | {"serving.engine"}}
    assert "serving.engine" in heavy_imports(bad, "serving.protocol")
    source = "import os\nif os:\n    import torch.nn\nclass A:\n    from model import B\ndef f():\n    import step\n"
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    assert loaded_imports(str(path)) == {"os", "torch.nn", "model", "model.B"}


def undocumented_routes(app_source: str, readme: str) -> list[str]:
    """The routes app.py declares (@app.get/post/delete) that no row of the README's endpoint table names with its
    method: a path with parameters is named up to its first "{"."""
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    missing = []
    for method, path in re.findall(r'@app\.(get|post|delete)\("([^"]+)"\)', app_source):
        key = re.escape(path.split("{")[0]) + ("" if "{" in path else r"(?![\w/])")
        if not any(re.search(key, row) and method.upper() in row for row in rows):
            missing.append(f"{method.upper()} {path}")
    return missing


def test_the_serving_readme_names_every_route():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "serving", "app.py"), encoding="utf-8") as f:
        source = f.read()
    with open(os.path.join(root, "serving", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert undocumented_routes(source, readme) == []
    assert undocumented_routes(source + '\n@app.post("/v1/audio")\n', readme) == ["POST /v1/audio"]  # can fail
    assert undocumented_routes('@app.get("/v1/messages")', readme) == ["GET /v1/messages"]  # the method counts
