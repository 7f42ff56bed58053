"""The Comfy Registry archive (comfy node publish) holds the pack and its example workflows, and no
test data: git-tracked files, minus the .comfyignore patterns, plus pyproject's [tool.comfy] includes."""

from pathlib import Path

from support.registry_archive import archive_files, ignored

REPO = Path(__file__).resolve().parents[1]


def test_archive_has_the_pack_and_no_test_data():
    files, includes = archive_files()
    assert "example_workflows/" in includes
    for must in ("__init__.py", "pyproject.toml", "requirements.txt", "README.md", "LICENSE",
                 "nodes/__init__.py", "lingbot_core/__init__.py",
                 # the help pages ComfyUI serves from WEB_DIRECTORY and the Chinese names it serves from /i18n
                 "web/docs/GenerateVideo.md", "web/docs/GenerateVideo/zh.md", "locales/zh/nodeDefs.json"):
        assert must in files, must
    assert any(p.startswith("example_workflows/") and p.endswith(".json") for p in files)
    leaked = sorted(p for p in files if p.split("/")[0] in ("tests", "bench", ".ci") or p.startswith("docs/images/")
                    or p.endswith((".npz", ".safetensors", ".pt", ".bin")))
    assert not leaked, leaked


def test_the_reader_evaluates_patterns_like_git():
    rules = [(True, True, "tests"), (False, False, "*.npz")]
    assert ignored("tests/data/x.npz", rules) and ignored("a/b/c.npz", rules)
    assert not ignored("lingbot_core/tests.py", rules) and not ignored("tests", rules)
