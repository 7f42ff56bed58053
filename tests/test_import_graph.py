"""The core's modules import one another one way only (imports inside functions count too).

A cycle is how a "bottom" module starts depending on the loader again: the file-I/O module
(checkpoint_files) must stay importable without the model, the pipeline or the loader.
"""

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "lingbot_core"


def core_imports(path: Path) -> set:
    """The ``lingbot_core`` modules ``path`` imports, by module name, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import a, b
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lingbot_core."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lingbot_core."))
    return found


def import_graph(root: Path = CORE) -> dict:
    modules = {p.stem for p in root.glob("*.py")}
    # The package's __init__ and __main__ re-export; they are entry points, not modules others build on.
    return {p.stem: sorted(core_imports(p) & modules - {p.stem}) for p in root.glob("*.py")
            if p.stem not in ("__init__", "__main__")}


def find_cycle(graph: dict):
    """One cycle as a list of module names (first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue  # __init__ (``from . import x`` of a package-level name)
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_core_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "lingbot_core modules import one another in a circle: " + " -> ".join(cycle)


def test_file_io_module_is_at_the_bottom():
    graph = import_graph()
    assert set(graph["checkpoint_files"]) <= {"fp8"}, graph["checkpoint_files"]
    for user in ("loading", "lora", "memory", "vae_layout"):
        assert "checkpoint_files" in graph[user], user


def test_the_walk_sees_imports_inside_functions(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from .b import x\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    (tmp_path / "c.py").write_text("import lingbot_core.a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": ["b"], "b": ["a"], "c": ["a"]}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
