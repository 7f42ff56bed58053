"""scripts/test: which tests its arguments select (the environment set-up and pytest are stand-ins)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory):
    """A copy of scripts/test in a tree whose setup-env does nothing and whose python prints its argv."""
    root = tmp_path_factory.mktemp("repo")
    (root / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "test", root / "scripts" / "test")
    (root / "scripts" / "setup-env").write_text("#!/usr/bin/env bash\nexit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (root / "tests").mkdir()
    (root / "tests" / "test_cli.py").write_text("")
    (root / "tests" / "test_cli_extra.py").write_text("")
    (root / "outside.py").write_text("")
    for f in ("scripts/test", "scripts/setup-env", ".venv/bin/python"):
        os.chmod(root / f, 0o755)
    return root


def pytest_args(root, *args):
    out = subprocess.run([str(root / "scripts" / "test"), *args], cwd=root, capture_output=True, text=True, check=True)
    argv = out.stdout.splitlines()
    assert argv[:2] == ["-m", "pytest"]
    return [a for a in argv[2:] if a not in ("-q", "-ra")]


@pytest.mark.parametrize("args, expected", [
    ((), ["tests"]),
    (("tests/test_cli.py",), ["tests/test_cli.py"]),
    (("tests/test_cli.py::test_one", "-x"), ["tests/test_cli.py::test_one", "-x"]),
    (("-x", "tests/test_cli.py", "tests/test_cli_extra.py"), ["-x", "tests/test_cli.py", "tests/test_cli_extra.py"]),
    (("-k", "test_cli"), ["tests", "-k", "test_cli"]),  # an expression, not a path: whole suite, filtered
    (("-m", "not comfy"), ["tests", "-m", "not comfy"]),
    (("--deselect", "tests/test_cli.py::test_one"), ["tests", "--deselect", "tests/test_cli.py::test_one"]),
    (("outside.py",), ["tests", "outside.py"]),  # only paths inside tests/ narrow the run
])
def test_arguments_narrow_the_run_only_when_they_name_tests(fake_repo, args, expected):
    assert pytest_args(fake_repo, *args) == expected
