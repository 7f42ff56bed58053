"""The repository's modules import one another one way only (imports inside functions count too), and
lingbot_core's wings keep their layers.

A cycle is how a "bottom" module starts depending on the loader again. The wings' directions are the
ones their ``__init__.py`` states: files/ at the bottom, model/ above it, memory/ and sampling/ beside
each other above the model, net/ on its own with prompts/ above it, parallel/ above the model and the
sampling (it is handed a pipeline, never imports one); no wing imports the top-level
modules (loading, pipeline, pipeline_pool, cli, remote), and the product never imports testing/.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("lingbot_core", "nodes", "bench", "scripts")

# wing -> the other wings it may import
WING_RULES = {
    "files": set(),
    "model": {"files"},
    "memory": {"files", "model"},
    "sampling": {"model"},
    "net": set(),
    "prompts": {"net", "files"},
    "parallel": {"model", "sampling"},
    "testing": {"files", "model"},
}
MAX_TOP_MODULES = 8


def module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path, name: str) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(path: Path, name: str, known: set) -> set:
    """The repository modules ``path`` imports, by dotted name, wherever the import statement is."""
    package = _package_of(path, name)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import mod`` depends on pkg.mod; on pkg itself only for names that are not modules
            subs = [f"{target}.{a.name}" if target else a.name for a in node.names]
            candidates = [s for s in subs if s in known]
            if len(candidates) < len(subs):
                candidates.append(target)
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for cand in candidates:
            # "import a.b.c" also runs a and a.b; the deepest known module is the edge that matters
            while cand and cand not in known:
                cand = cand.rpartition(".")[0]
            if cand:
                found.add(cand)
    return found


def repo_graph(repo: Path = REPO, roots=ROOTS) -> dict:
    files = {}
    for root in roots:
        for path in (repo / root).rglob("*.py"):
            files[module_name(path, repo)] = path
    known = set(files)
    graph = {}
    for name, path in files.items():
        # a package's __init__ importing its own submodules (re-exports) is no dependency of theirs
        deps = imports_of(path, name, known) - {name}
        graph[name] = sorted(d for d in deps if not name.startswith(d + ".") and not (d == name.partition(".")[0]))
    return graph


def find_cycle(graph: dict):
    """One cycle as a list of module names (first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
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


def wing_of(name: str):
    """``files`` for lingbot_core.files.fp8, None for a top-level core module or anything outside the core."""
    parts = name.split(".")
    if parts[0] != "lingbot_core" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in WING_RULES else None


def wing_violations(graph: dict) -> list:
    bad = []
    for name, deps in graph.items():
        if not name.startswith("lingbot_core"):
            continue
        for dep in deps:
            if not dep.startswith("lingbot_core"):
                bad.append(f"{name} -> {dep} (the core imports nothing of the pack's hosts, benches or scripts)")
                continue
            here, there = wing_of(name), wing_of(dep)
            if there == "testing" and here != "testing":
                bad.append(f"{name} -> {dep} (the product never imports the test fixtures)")
            elif here is None or here == there or dep == "lingbot_core":
                continue
            elif there is None:
                bad.append(f"{name} -> {dep} (a wing never imports the top-level modules)")
            elif there not in WING_RULES[here]:
                bad.append(f"{name} -> {dep} ({here}/ may import {sorted(WING_RULES[here]) or 'nothing of the pack'})")
    return bad


def test_repository_import_graph_has_no_cycle():
    cycle = find_cycle(repo_graph())
    assert cycle is None, "modules import one another in a circle: " + " -> ".join(cycle)


def test_wings_import_only_in_their_stated_directions():
    assert wing_violations(repo_graph()) == []


def test_every_wing_is_a_package_with_its_rule_stated():
    core = REPO / "lingbot_core"
    wings = {p.name for p in core.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert wings == set(WING_RULES)
    for wing in wings:
        doc = ast.get_docstring(ast.parse((core / wing / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "import" in doc.lower(), f"lingbot_core/{wing}/__init__.py must say what it may import"


def test_the_core_top_level_stays_short():
    top = sorted(p.name for p in (REPO / "lingbot_core").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_nodes_benches_and_scripts_keep_their_places():
    graph = repo_graph()
    for name, deps in graph.items():
        root = name.partition(".")[0]
        for dep in deps:
            dep_root = dep.partition(".")[0]
            if root == "nodes":
                assert dep_root in ("nodes", "lingbot_core"), (name, dep)
                assert wing_of(dep) != "testing", (name, dep)
            if root == "bench":
                assert dep_root in ("bench", "lingbot_core"), (name, dep)


def test_the_walk_sees_imports_inside_functions_and_relative_levels(tmp_path):
    core = tmp_path / "lingbot_core"
    (core / "files").mkdir(parents=True)
    (core / "model").mkdir()
    (core / "__init__.py").write_text("")
    (core / "files" / "__init__.py").write_text("")
    (core / "model" / "__init__.py").write_text("")
    (core / "pipeline.py").write_text("from .model import net\n")
    (core / "files" / "reader.py").write_text("def f():\n    from ..model.net import x\n")
    (core / "model" / "net.py").write_text("from ..files import reader\n")
    graph = repo_graph(tmp_path, roots=("lingbot_core",))
    assert graph["lingbot_core.files.reader"] == ["lingbot_core.model.net"]
    assert graph["lingbot_core.model.net"] == ["lingbot_core.files.reader"]
    assert graph["lingbot_core.pipeline"] == ["lingbot_core.model.net"]
    assert find_cycle(graph) is not None
    assert wing_violations(graph) == ["lingbot_core.files.reader -> lingbot_core.model.net (files/ may import nothing of the pack)"]


def test_a_wrong_way_import_in_the_real_tree_is_caught(tmp_path):
    """The real core, copied, with one wrong-way import planted (the file reader importing the pipeline)."""
    import shutil

    shutil.copytree(REPO / "lingbot_core", tmp_path / "lingbot_core", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "lingbot_core" / "files" / "checkpoint_files.py"
    target.write_text(target.read_text(encoding="utf-8") + "\n\ndef _planted():\n    from ..pipeline import LingbotPipeline\n")
    graph = repo_graph(tmp_path, roots=("lingbot_core",))
    assert any("files.checkpoint_files -> lingbot_core.pipeline" in v for v in wing_violations(graph))
    assert find_cycle(graph) is not None


# -- the tests: rooms that mirror the code, helpers in support/ ------------------------------------

TESTS = REPO / "tests"
# tests/<room>/ for each core wing, the core's top level (pipeline), the nodes in a real ComfyUI (host), and the
# benches and scripts (tooling); lingbot_core/testing/ is checked where the packages it writes are used.
ROOMS = set(WING_RULES) - {"testing"} | {"pipeline", "host", "tooling"}
MAX_TOP_TESTS = 5


def _top_imports(path: Path) -> set:
    """First components of the absolute imports in ``path`` (``support`` for ``from support.x import y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.partition(".")[0] for a in node.names}
    return found


def _is_test_module(name: str) -> bool:
    return name.startswith("test_") or name == "conftest"


def suite_violations(tests: Path = TESTS, repo: Path = REPO) -> list:
    bad = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        for dep in sorted(_top_imports(path)):
            if _is_test_module(dep):
                bad.append(f"tests/{rel} imports {dep} (shared helpers live in tests/support/)")
    for root in ("lingbot_core", "nodes", "bench", "scripts"):
        for path in sorted((repo / root).rglob("*.py")):
            deps = _top_imports(path)
            if root in ("lingbot_core", "nodes") and "support" in deps:
                bad.append(f"{path.relative_to(repo)} imports the tests' support package")
            bad += [f"{path.relative_to(repo)} imports {d} (a test)" for d in sorted(deps) if _is_test_module(d)]
    return bad


def test_tests_import_the_code_and_support_never_one_another():
    assert suite_violations() == []


def test_a_test_importing_another_test_is_caught(tmp_path):
    (tmp_path / "tests" / "model").mkdir(parents=True)
    (tmp_path / "tests" / "support").mkdir()
    (tmp_path / "tests" / "support" / "graphs.py").write_text("from test_lora import lightx2v_lora\n")
    (tmp_path / "tests" / "model" / "test_a.py").write_text("def f():\n    from conftest import TINY\n")
    for root in ("lingbot_core", "nodes", "bench", "scripts"):
        (tmp_path / root).mkdir()
    (tmp_path / "nodes" / "loader.py").write_text("from support.comfy_graphs import loader\n")
    assert suite_violations(tmp_path / "tests", tmp_path) == [
        "tests/model/test_a.py imports conftest (shared helpers live in tests/support/)",
        "tests/support/graphs.py imports test_lora (shared helpers live in tests/support/)",
        "nodes/loader.py imports the tests' support package",
    ]


def test_tests_live_in_the_rooms_of_the_code_they_check():
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert len(top) <= MAX_TOP_TESTS, top
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in ("data", "support", "__pycache__")}
    assert folders == ROOMS
    for room in ROOMS:
        files = list((TESTS / room).glob("*.py"))
        assert files and all(p.name.startswith("test_") or p.name == "conftest.py" for p in files), room
        assert not (TESTS / room / "__init__.py").exists()  # pytest imports them by file name, as the top's
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name (pytest imports test files by name)"


def test_every_support_module_says_what_it_fakes_or_starts():
    for path in sorted((TESTS / "support").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc and len(doc.splitlines()[0]) > 20, f"tests/support/{path.relative_to(TESTS / 'support')} needs a docstring"
