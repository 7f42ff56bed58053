#!/usr/bin/env python3
"""Write the pack's help pages for ComfyUI's node help panel, in English and Chinese.

    .venv/bin/python scripts/build_help.py            # write web/docs/ (and skeletons for new nodes)
    .venv/bin/python scripts/build_help.py --check    # exit 1 if a committed page is out of date

ComfyUI's frontend shows ``<WEB_DIRECTORY>/docs/<NodeName>/<locale>.md`` for a custom node, falling
back to ``docs/<NodeName>.md``, and translates node names and tooltips from ``locales/<lang>/nodeDefs.json``
(served by ``GET /i18n``). Each fact has one source; the pages are generated from them:

- English names, descriptions and tooltips: the node classes (``DESCRIPTION``, ``INPUT_TYPES`` tooltips,
  ``OUTPUT_TOOLTIPS``, ``NODE_DISPLAY_NAME_MAPPINGS``), read from ComfyUI's own node registry;
- Chinese names, descriptions and tooltips: ``locales/zh/nodeDefs.json`` (ComfyUI reads it as it is);
- the per-node "when to use it" text: ``help/en/<NodeName>.md`` and ``help/zh/<NodeName>.md``;
- which example workflow shows a node: the node types in ``example_workflows/*.json``, described by
  ``help/workflows.json``.

A node registered without these sources gets skeletons marked ``TODO`` (English text as a placeholder
in the Chinese file): fill them in and run this script again. ``tests/tooling/test_help_pages.py`` fails
while a ``TODO`` is left or a page differs from what this script writes.

Reading the registry imports ComfyUI, which sets process-wide state: that happens in a child process
(this file with ``--child``), with the pack linked into a fresh ComfyUI base directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "web" / "docs"
HELP = REPO / "help"
ZH_NODEDEFS = REPO / "locales" / "zh" / "nodeDefs.json"
WORKFLOWS = REPO / "example_workflows"
PACK_MODULE = "custom_nodes.lingbot-video-nodes"
TODO = "TODO"

#: Section labels and phrases of the generated pages.
WORDS = {
    "en": {
        "inputs": "Inputs", "outputs": "Outputs", "examples": "Example workflows", "optional": "optional",
        "default": "default", "range": "{lo} to {hi}", "step": "step", "one_of": "one of",
        "files": "a list of what is installed", "sep": ", ", "colon": ": ", "open": " (", "close": ")",
        "where": "Open them from ComfyUI's template browser, under **lingbot-video-nodes**:",
        "no_examples": "No example workflow uses this node yet.", "no_inputs": "None.",
    },
    "zh": {
        "inputs": "输入", "outputs": "输出", "examples": "示例工作流", "optional": "可选输入",
        "default": "默认", "range": "{lo}–{hi}", "step": "步长", "one_of": "选项",
        "files": "列出已安装的内容", "sep": "，", "colon": "：", "open": "（", "close": "）",
        "where": "在 ComfyUI 的模板浏览器中打开（位于 **lingbot-video-nodes** 下）：",
        "no_examples": "目前还没有示例工作流使用此节点。", "no_inputs": "无。",
    },
}


# --------------------------------------------------------------------------------------------
# The node registry (child process)
# --------------------------------------------------------------------------------------------

def node_schemas(timeout: float = 300) -> dict:
    """{node: {display_name, description, inputs: [...], outputs: [...]}} for every node of the pack,
    in registration order, as ComfyUI 0.3.75+ registers them (hidden inputs left out)."""
    with tempfile.TemporaryDirectory(prefix="lingbot-help-") as tmp:
        out = Path(tmp) / "schemas.json"
        env = {k: v for k, v in os.environ.items() if k != "LINGBOT_SERVERS"}  # lists must not depend on the machine
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run([sys.executable, __file__, "--child", str(out), str(Path(tmp) / "base")],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"schema child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _input_entry(name: str, spec, optional: bool) -> dict:
    kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    entry = {"name": name, "optional": optional, "tooltip": opts.get("tooltip")}
    if isinstance(kind, list):
        entry["type"] = "COMBO"
        # Lists read from folders or the server list hold a "(...)" placeholder when empty: such a
        # list depends on the machine, so the page describes it instead of listing it.
        entry["choices"] = None if any(str(c).startswith("(") for c in kind) else [str(c) for c in kind]
    else:
        entry["type"] = str(kind)
    for key in ("default", "min", "max", "step", "multiline", "forceInput"):
        if key in opts:
            entry[key] = opts[key]
    return entry


def _child(out: str, base: str) -> None:
    sys.path.insert(0, str(REPO / "tests"))  # the support package: ComfyUI in this process
    from support.comfy_inprocess import InProcessComfy

    comfy = InProcessComfy(base)
    schemas = {}
    for name, cls in comfy.nodes.NODE_CLASS_MAPPINGS.items():
        if getattr(cls, "RELATIVE_PYTHON_MODULE", None) != PACK_MODULE:
            continue
        spec = cls.INPUT_TYPES()
        inputs = [_input_entry(k, v, section == "optional")
                  for section in ("required", "optional") for k, v in (spec.get(section) or {}).items()]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        tips = getattr(cls, "OUTPUT_TOOLTIPS", None) or [None] * len(cls.RETURN_TYPES)
        schemas[name] = {
            "display_name": comfy.nodes.NODE_DISPLAY_NAME_MAPPINGS.get(name, name),
            "description": getattr(cls, "DESCRIPTION", None),
            "inputs": inputs,
            "outputs": [{"name": n, "type": str(t), "tooltip": tip}
                        for n, t, tip in zip(names, cls.RETURN_TYPES, tips)],
        }
    Path(out).write_text(json.dumps(schemas))


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

def workflow_nodes() -> dict[str, list[str]]:
    """{workflow stem: node types it uses (subgraphs included)}."""
    uses = {}
    for path in sorted(WORKFLOWS.glob("*.json")):
        data = json.loads(path.read_text())
        nodes = list(data.get("nodes", []))
        for sub in (data.get("definitions") or {}).get("subgraphs", []):
            nodes += sub.get("nodes", [])
        uses[path.stem] = sorted({n.get("type") for n in nodes if isinstance(n.get("type"), str)})
    return uses


def zh_skeleton(schema: dict) -> dict:
    """A nodeDefs.json entry holding the English text, each string marked TODO for translation."""
    todo = lambda text: f"{TODO}: {text or ''}".strip()  # noqa: E731
    return {
        "display_name": todo(schema["display_name"]),
        "description": todo(schema["description"]),
        "inputs": {i["name"]: {"name": todo(i["name"]), "tooltip": todo(i["tooltip"])} for i in schema["inputs"]},
        "outputs": {str(k): {"name": todo(o["name"]), "tooltip": todo(o["tooltip"])}
                    for k, o in enumerate(schema["outputs"])},
    }


def load_sources(schemas: dict) -> dict:
    """The hand-written sources, with skeletons (marked TODO) for what a registered node lacks."""
    zh = json.loads(ZH_NODEDEFS.read_text()) if ZH_NODEDEFS.is_file() else {}
    described = json.loads((HELP / "workflows.json").read_text()) if (HELP / "workflows.json").is_file() else {}
    uses = workflow_nodes()
    texts = {lang: {} for lang in WORDS}
    for node, schema in schemas.items():
        skeleton = zh_skeleton(schema)
        entry = zh.setdefault(node, skeleton)
        for field in ("display_name", "description"):
            entry.setdefault(field, skeleton[field])
        for part in ("inputs", "outputs"):  # a new input or output: its skeleton
            for key, value in skeleton[part].items():
                entry.setdefault(part, {}).setdefault(key, value)
        for lang in WORDS:
            path = HELP / lang / f"{node}.md"
            texts[lang][node] = path.read_text() if path.is_file() else f"{TODO}: when to use {node} ({lang}).\n"
    for stem in uses:
        described.setdefault(stem, {lang: f"{TODO}: what {stem} shows ({lang})" for lang in WORDS})
    return {"zh": zh, "texts": texts, "workflows": described, "uses": uses}


# --------------------------------------------------------------------------------------------
# Pages
# --------------------------------------------------------------------------------------------

def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f"`{v}`" if v else '`""`'
    return str(v)


def _facts(entry: dict, w: dict) -> list[str]:
    facts = [f"`{entry['type']}`" if entry["type"] != "COMBO" else ""]
    if entry["type"] == "COMBO":
        facts = [f"{w['one_of']} " + " / ".join(f"`{c}`" for c in entry["choices"])
                 if entry.get("choices") is not None else w["files"]]
    if "default" in entry and not (entry["type"] == "STRING" and entry["default"] == ""):
        facts.append(f"{w['default']} {_value(entry['default'])}")
    if "min" in entry and "max" in entry and entry["max"] < 2 ** 53:
        facts.append(w["range"].format(lo=entry["min"], hi=entry["max"]))
    if entry.get("step") not in (None, 1) and entry["type"] in ("INT", "FLOAT"):
        facts.append(f"{w['step']} {entry['step']}")
    if entry["optional"]:
        facts.append(w["optional"])
    return [f for f in facts if f]


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def render_page(node: str, schema: dict, lang: str, sources: dict) -> str:
    w = WORDS[lang]
    zh = sources["zh"][node] if lang == "zh" else None
    title = zh["display_name"] if zh else schema["display_name"]
    description = zh["description"] if zh else schema["description"]
    lines = [f"# {title}", "", _one_line(description), "", sources["texts"][lang][node].strip(), "",
             f"## {w['inputs']}", ""]
    for entry in schema["inputs"]:
        name = entry["name"]
        tip = zh["inputs"][name]["tooltip"] if zh else entry["tooltip"]
        label = f"**{zh['inputs'][name]['name']}** `{name}`" if zh else f"**{name}**"
        lines.append(f"- {label}{w['open']}{w['sep'].join(_facts(entry, w))}{w['close']}{w['colon']}{_one_line(tip)}")
    if not schema["inputs"]:
        lines.append(w["no_inputs"])
    lines += ["", f"## {w['outputs']}", ""]
    for k, out in enumerate(schema["outputs"]):
        tip = zh["outputs"][str(k)]["tooltip"] if zh else out["tooltip"]
        label = f"**{zh['outputs'][str(k)]['name']}** `{out['name']}`" if zh else f"**{out['name']}**"
        lines.append(f"- {label}{w['open']}`{out['type']}`{w['close']}{w['colon']}{_one_line(tip)}")
    lines += ["", f"## {w['examples']}", ""]
    shown = [stem for stem, types in sources["uses"].items() if node in types]
    if shown:
        lines += [w["where"], ""]
        lines += [f"- `{stem}`{w['colon']}{sources['workflows'][stem][lang]}" for stem in shown]
    else:
        lines.append(w["no_examples"])
    return "\n".join(lines) + "\n"


def render_all(schemas: dict, sources: dict) -> dict[Path, str]:
    """{path: text} of every generated file."""
    files = {}
    for node, schema in schemas.items():
        files[DOCS / f"{node}.md"] = render_page(node, schema, "en", sources)
        files[DOCS / node / "zh.md"] = render_page(node, schema, "zh", sources)
    return files


def write_sources(schemas: dict, sources: dict) -> list[Path]:
    """Write skeletons for whatever a registered node lacks; returns the files written."""
    written = []
    current = json.loads(ZH_NODEDEFS.read_text()) if ZH_NODEDEFS.is_file() else {}
    if current != sources["zh"]:
        ZH_NODEDEFS.parent.mkdir(parents=True, exist_ok=True)
        ZH_NODEDEFS.write_text(json.dumps(sources["zh"], ensure_ascii=False, indent=2) + "\n")
        written.append(ZH_NODEDEFS)
    for lang, texts in sources["texts"].items():
        for node, text in texts.items():
            path = HELP / lang / f"{node}.md"
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                written.append(path)
    path = HELP / "workflows.json"
    if not path.is_file() or json.loads(path.read_text()) != sources["workflows"]:
        path.write_text(json.dumps(sources["workflows"], ensure_ascii=False, indent=2) + "\n")
        written.append(path)
    return written


def stale_pages(files: dict[Path, str]) -> list[Path]:
    """Markdown under web/docs that no registered node generates (a renamed or removed node)."""
    return sorted(p for p in DOCS.rglob("*.md") if p not in files) if DOCS.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a page is out of date")
    ap.add_argument("--child", nargs=2, metavar=("OUT", "BASE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    schemas = node_schemas()
    sources = load_sources(schemas)
    files = render_all(schemas, sources)
    differ = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
    stale = stale_pages(files)
    if args.check:
        for p in differ + stale:
            print(f"out of date: {p.relative_to(REPO)}")
        return 1 if differ or stale else 0
    for p in write_sources(schemas, sources):
        print(f"skeleton: {p.relative_to(REPO)} (replace its {TODO} text)")
    for p in differ:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p])
        print(f"wrote {p.relative_to(REPO)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(REPO)}")
    todo = [p for p in files if TODO in files[p]]
    if todo:
        print(f"{len(todo)} pages still hold {TODO} text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
