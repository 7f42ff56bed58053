"""What ``comfy node publish`` puts in the Comfy Registry archive: git-tracked files, minus .comfyignore, plus
pyproject's [tool.comfy] includes."""

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
