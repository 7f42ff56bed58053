"""scripts/test: which tests its arguments select (the environment set-up and pytest are stand-ins)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory):
    """A copy of scripts/test in a tree whose setup-env does nothing and whose python prints its argv."""
    root = tmp_path_factory.mktemp("repo")
    (root / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "test", root / "scripts" / "test")
    (root / "scripts" / "setup-env").write_text("#!/usr/bin/env bash\nexit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (root / "tests" / "pipeline").mkdir(parents=True)
    (root / "tests" / "host").mkdir()
    (root / "tests" / "pipeline" / "test_cli.py").write_text("")
    (root / "tests" / "pipeline" / "test_cli_extra.py").write_text("")
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
    (("tests/pipeline/test_cli.py",), ["tests/pipeline/test_cli.py"]),
    (("tests/pipeline/test_cli.py::test_one", "-x"), ["tests/pipeline/test_cli.py::test_one", "-x"]),
    (("-x", "tests/pipeline/test_cli.py", "tests/pipeline/test_cli_extra.py"), ["-x", "tests/pipeline/test_cli.py", "tests/pipeline/test_cli_extra.py"]),
    (("tests/host", "-x"), ["tests/host", "-x"]),  # a room: its tests alone
    (("-k", "test_cli"), ["tests", "-k", "test_cli"]),  # an expression, not a path: whole suite, filtered
    (("-m", "not comfy"), ["tests", "-m", "not comfy"]),
    (("--deselect", "tests/pipeline/test_cli.py::test_one"), ["tests", "--deselect", "tests/pipeline/test_cli.py::test_one"]),
    (("outside.py",), ["tests", "outside.py"]),  # only paths inside tests/ narrow the run
])
def test_arguments_narrow_the_run_only_when_they_name_tests(fake_repo, args, expected):
    assert pytest_args(fake_repo, *args) == expected


@pytest.fixture(scope="module")
def host_repo(tmp_path_factory):
    """scripts/test-host and scripts/test in a tree whose python prints its argv and COMFYUI_DIR."""
    root = tmp_path_factory.mktemp("host-repo")
    (root / "scripts").mkdir()
    for name in ("test", "test-host"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    (root / "scripts" / "setup-env").write_text("#!/usr/bin/env bash\nexit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" "COMFYUI_DIR=${COMFYUI_DIR:-}"\n')
    (root / "tests").mkdir()
    comfy = root / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("")
    (comfy / "comfyui_version.py").write_text('__version__ = "0.46.0"\n')
    for f in ("scripts/test", "scripts/test-host", "scripts/setup-env", ".venv/bin/python"):
        os.chmod(root / f, 0o755)
    return root


def test_host_runner_selects_the_real_host_tests_of_the_given_checkout(host_repo):
    out = subprocess.run([str(host_repo / "scripts" / "test-host"), str(host_repo / "ComfyUI"), "-x"],
                         cwd=host_repo, capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    lines = out.stdout.splitlines()
    assert "ComfyUI 0.46.0 at" in lines[0]
    argv = lines[1:]
    assert argv[:2] == ["-m", "pytest"] and ["-m", "comfy"] == argv[argv.index("tests") + 1:argv.index("tests") + 3]
    assert "-x" in argv and argv[-1] == f"COMFYUI_DIR={(host_repo / 'ComfyUI').resolve()}"


def test_host_runner_refuses_a_folder_without_main_py(host_repo, tmp_path):
    out = subprocess.run([str(host_repo / "scripts" / "test-host"), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "no main.py" in out.stderr
