"""The Comfy Registry archive (comfy node publish) holds the pack and its example workflows, and no
test data: git-tracked files, minus the .comfyignore patterns, plus pyproject's [tool.comfy] includes."""

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ignore_rules():
    """.comfyignore as (anchored, directory, pattern); refuses forms this reader does not evaluate."""
    rules = []
    for raw in (REPO / ".comfyignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!") and "**" not in line, f"unsupported .comfyignore form: {line!r}"
        anchored = line.startswith("/") or "/" in line.rstrip("/")
        rules.append((anchored, line.endswith("/"), line.strip("/")))
    return rules


def ignored(path: str, rules) -> bool:
    parts = path.split("/")
    for anchored, directory, pattern in rules:
        n = pattern.count("/") + 1
        starts = [0] if anchored else range(len(parts))
        for i in starts:
            window = "/".join(parts[i:i + n])
            is_dir = i + n < len(parts)
            if fnmatch.fnmatchcase(window, pattern) and (is_dir or not directory):
                return True
    return False


def archive_files():
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    rules = ignore_rules()
    files = {p for p in tracked if not ignored(p, rules)}
    includes = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["comfy"].get("includes", [])
    for inc in includes:
        files |= {p for p in tracked if p.startswith(inc.rstrip("/") + "/")}
    return files, includes


def test_archive_has_the_pack_and_no_test_data():
    files, includes = archive_files()
    assert "example_workflows/" in includes
    for must in ("__init__.py", "pyproject.toml", "requirements.txt", "README.md", "LICENSE",
                 "nodes/__init__.py", "lingbot_core/__init__.py"):
        assert must in files, must
    assert any(p.startswith("example_workflows/") and p.endswith(".json") for p in files)
    leaked = sorted(p for p in files if p.split("/")[0] in ("tests", "bench", ".ci") or p.startswith("docs/images/")
                    or p.endswith((".npz", ".safetensors", ".pt", ".bin")))
    assert not leaked, leaked


def test_the_reader_evaluates_patterns_like_git():
    rules = [(True, True, "tests"), (False, False, "*.npz")]
    assert ignored("tests/data/x.npz", rules) and ignored("a/b/c.npz", rules)
    assert not ignored("lingbot_core/tests.py", rules) and not ignored("tests", rules)
