"""pyproject.toml (what an install from the registry or `pip install .` gets) and requirements.txt (what
`pip install -r` and ComfyUI Manager get) list the same runtime dependencies, and neither lists torch."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def requirement_lines(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_and_requirements_list_the_same_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    from_pyproject = sorted(re.sub(r"\s+", "", r) for r in project["dependencies"])
    from_requirements = sorted(re.sub(r"\s+", "", r) for r in requirement_lines((REPO / "requirements.txt").read_text(encoding="utf-8")))
    assert from_pyproject == from_requirements
    assert "gguf" in {name_of(r) for r in from_pyproject}  # the GGUF reader of the files loader


def test_neither_lists_torch():
    # ComfyUI users already have their CUDA build; pip would replace it.
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {name_of(r) for r in project["dependencies"]}
    names |= {name_of(r) for r in requirement_lines((REPO / "requirements.txt").read_text(encoding="utf-8"))}
    assert not names & {"torch", "torchvision", "torchaudio"}
