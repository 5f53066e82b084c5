"""The project's layering: its import graph (lazy imports included) is a DAG, and library modules import no CLI
plumbing and take no argparse objects."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = {"generate", "serve", "bench", "export", "quality", "loadtest", "streaming"}  # parse flags, call the library
CLI = {"cli"}  # what the entry points share


def project_modules() -> dict[str, ast.Module]:
    return {name[:-3]: ast.parse(open(os.path.join(ROOT, name), encoding="utf-8").read())
            for name in os.listdir(ROOT) if name.endswith(".py")}


def imports(tree: ast.Module, names: set[str]) -> set[str]:
    """Project modules imported anywhere in the module, inside functions too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & names


def test_import_graph_is_a_dag():
    modules = project_modules()
    graph = {m: imports(tree, set(modules)) - {m} for m, tree in modules.items()}
    order, state = [], {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "active", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "active"
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert set(order) == set(modules)


def test_library_modules_import_no_cli_plumbing():
    modules = project_modules()
    for name, tree in modules.items():
        if name in ENTRY_POINTS | CLI:
            continue
        used = imports(tree, set(modules) | {"argparse"})
        assert not used & (ENTRY_POINTS | CLI | {"argparse"}), f"{name}.py imports {used & (ENTRY_POINTS | CLI)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None:
                assert "Namespace" not in ast.unparse(node.annotation), f"{name}.py takes an argparse Namespace"
