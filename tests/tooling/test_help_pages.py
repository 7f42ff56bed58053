"""The help pages ComfyUI shows for each node (web/docs/), in English and Chinese, and the Chinese node
names and tooltips (locales/zh/nodeDefs.json): complete for every registered node and input, generated
from their sources (scripts/build_help.py), and served where the frontend looks for them."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from support.comfy_host import PACK_NAME, comfyui_unavailable_reason

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_help", REPO / "scripts" / "build_help.py")
build_help = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_help)

RUN = "run `.venv/bin/python scripts/build_help.py` and commit web/docs/"
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def schemas():
    """Every node of the pack as ComfyUI 0.3.75 registers it (a child process imports ComfyUI)."""
    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return build_help.node_schemas()


@pytest.fixture(scope="module")
def sources(schemas):
    return build_help.load_sources(schemas)


def test_the_committed_pages_are_what_the_sources_generate(schemas, sources):
    files = build_help.render_all(schemas, sources)
    assert len(files) == 2 * len(schemas) >= 30
    differ = [str(p.relative_to(REPO)) for p, text in files.items()
              if not p.is_file() or p.read_text(encoding="utf-8") != text]
    assert not differ, f"help pages out of date ({RUN}): {differ}"
    stale = [str(p.relative_to(REPO)) for p in build_help.stale_pages(files)]
    assert not stale, f"pages of nodes that are not registered ({RUN}): {stale}"


def test_every_node_input_and_output_has_english_and_chinese_text(schemas, sources):
    zh = json.loads(build_help.ZH_NODEDEFS.read_text(encoding="utf-8"))
    missing = [n for n in schemas if n not in zh]
    assert not missing, f"no Chinese entry in locales/zh/nodeDefs.json for {missing} ({RUN} for skeletons)"
    assert not set(zh) - set(schemas), f"Chinese entries for nodes that are not registered: {set(zh) - set(schemas)}"
    problems = []
    for node, schema in schemas.items():
        entry = zh[node]
        if not schema["description"]:
            problems.append(f"{node}: no DESCRIPTION")
        for field in ("display_name", "description"):
            if not CJK.search(entry.get(field) or ""):
                problems.append(f"{node}.{field}: no Chinese text")
        names = [i["name"] for i in schema["inputs"]]
        if set(entry.get("inputs", {})) != set(names):
            problems.append(f"{node}: Chinese inputs {sorted(entry.get('inputs', {}))} != {sorted(names)}")
        for item in schema["inputs"]:
            if not item["tooltip"]:
                problems.append(f"{node}.{item['name']}: no English tooltip")
            zh_item = entry.get("inputs", {}).get(item["name"], {})
            if not zh_item.get("name") or not CJK.search(zh_item.get("tooltip") or ""):
                problems.append(f"{node}.{item['name']}: no Chinese name or tooltip")
        if set(entry.get("outputs", {})) != {str(k) for k in range(len(schema["outputs"]))}:
            problems.append(f"{node}: Chinese outputs {sorted(entry.get('outputs', {}))}, {len(schema['outputs'])} registered")
        for k, out in enumerate(schema["outputs"]):
            zh_out = entry.get("outputs", {}).get(str(k), {})
            if not out["tooltip"]:
                problems.append(f"{node} output {k}: no English tooltip")
            if not zh_out.get("name") or not CJK.search(zh_out.get("tooltip") or ""):
                problems.append(f"{node} output {k}: no Chinese name or tooltip")
        for lang in build_help.WORDS:
            if not (build_help.HELP / lang / f"{node}.md").is_file():
                problems.append(f"{node}: no help/{lang}/{node}.md")
            elif lang == "zh" and not CJK.search(sources["texts"][lang][node]):
                problems.append(f"{node}: help/zh/{node}.md is not in Chinese")
    for stem, text in sources["workflows"].items():
        if not CJK.search(text.get("zh", "")) or not text.get("en"):
            problems.append(f"help/workflows.json: {stem} needs an English and a Chinese line")
    todo = [str(p.relative_to(REPO)) for p in [build_help.ZH_NODEDEFS, build_help.HELP / "workflows.json",
                                               *build_help.HELP.glob("*/*.md")]
            if build_help.TODO in p.read_text(encoding="utf-8")]
    if todo:
        problems.append(f"{build_help.TODO} text left in {todo}")
    assert not problems, "\n".join(problems)


def test_web_directory_holds_only_the_help_pages():
    """Everything under WEB_DIRECTORY is served, and its .js files would run in every user's browser."""
    assert re.search(r'^WEB_DIRECTORY = "\./web"$', (REPO / "__init__.py").read_text(), re.M)
    served = sorted(str(p.relative_to(REPO / "web")) for p in (REPO / "web").rglob("*") if p.is_file())
    assert served and all(p.startswith("docs/") and p.endswith(".md") for p in served), served


@pytest.mark.comfy
def test_comfyui_serves_the_pages_and_translations_where_the_frontend_reads_them(comfy_server):
    """Frontend 1.32.9 to 1.58.1 fetch /extensions/<pack>/docs/<Node>/<locale>.md, then docs/<Node>.md,
    with <pack> taken from the node's python_module, and merge GET /i18n into their messages."""
    info = comfy_server.object_info("GenerateVideo")
    assert info["python_module"] == f"custom_nodes.{PACK_NAME}"
    for rel in ("GenerateVideo.md", "GenerateVideo/zh.md"):
        status, raw = comfy_server._request("GET", f"/extensions/{PACK_NAME}/docs/{rel}")
        assert status == 200, rel
        assert raw == (REPO / "web" / "docs" / rel).read_bytes()
    zh = comfy_server.get("/i18n")["zh"]["nodeDefs"]
    committed = json.loads(build_help.ZH_NODEDEFS.read_text(encoding="utf-8"))
    assert zh["GenerateVideo"] == committed["GenerateVideo"]
    assert zh["GenerateVideo"]["display_name"] == "LingBot-Video 生成"
    assert not [e for e in comfy_server.get("/extensions") if f"/{PACK_NAME}/" in e]  # no script of ours runs
