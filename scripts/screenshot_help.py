#!/usr/bin/env python3
"""Check in a real browser that ComfyUI shows the pack's help pages and translations, and screenshot it.

    apt-get install -y chromium
    .venv/bin/python scripts/screenshot_help.py --locale zh --out /tmp/help_zh.png
    .venv/bin/python scripts/screenshot_help.py --locale en --front-end-root <frontend>/static --out /tmp/help_en.png

Starts a headless ComfyUI on CPU with this pack linked (``--front-end-root`` picks another frontend
build, e.g. from ``pip install --target DIR comfyui-frontend-package==X``), sets the frontend's language
(``Comfy.Locale``), places ``--node`` and LoadLingbotPipeline on the canvas, opens the node's help in the
node library panel (the selection toolbox's info button) and screenshots the window. Prints a
JSON line: the frontend version, the node titles drawn on the canvas, the help panel's heading and the
help URL the frontend fetched, so the result can be checked without looking at the picture.

The browser driving (Chromium over the DevTools protocol) is ``scripts/screenshot_workflow.py``'s.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import screenshot_workflow as shot  # noqa: E402  (also puts the repository and tests/ on sys.path)

# Place the node and a loader, select the node; return the titles the canvas draws.
PLACE = """(() => {
  const app = window.app, LG = window.LiteGraph;
  app.graph.clear();
  const loader = LG.createNode('LoadLingbotPipeline'); loader.pos = [40, 80]; app.graph.add(loader);
  const node = LG.createNode(%(node)s); node.pos = [420, 80]; app.graph.add(node);
  app.canvas.ds.scale = 0.75; app.canvas.ds.offset = [560, 60];  // right of the side panel
  app.canvas.selectNode(node);
  app.canvas.setDirty(true, true);
  return app.graph._nodes.map(n => n.title);
})()"""

# Click the selection toolbox's info button, as a user would: 1.32.9 opens the help in the node
# library panel, 1.58.1 in the right-side panel's Info tab. Returns the node's display name.
OPEN_HELP = """(() => {
  const button = document.querySelector('[data-testid="info-button"]');
  if (!button) return null;
  button.click();
  return window.app.graph._nodes.find(n => n.type === %(node)s).title;
})()"""

# The help page's own headings (a missing page shows the node's description instead, without them).
HELP_SHOWN = """(() => {
  const h1 = [...document.querySelectorAll('h1')].map(e => e.textContent.trim());
  const title = h1.find(t => t.includes(%(title)s));
  return title ? [title, ...[...document.querySelectorAll('h2')].map(e => e.textContent.trim())] : null;
})()"""

# What the frontend's i18n gives for the node's first input tooltip (the key itself when untranslated).
TOOLTIP = """(() => {
  const t = document.querySelector('#vue-app').__vue_app__.config.globalProperties.$t;
  const key = 'nodeDefs.' + %(node)s + '.inputs.' + %(input)s + '.tooltip';
  return t(key);
})()"""

HELP_FETCHES = """performance.getEntriesByType('resource').map(e => e.name)
  .filter(n => n.includes('/docs/')).map(n => n.replace(location.origin, ''))"""

# Keep every resource timing (the app loads more than the default 250 before the help is opened).
PRELOAD = "try { performance.setResourceTimingBufferSize(100000); } catch (e) {}"


def page_title(node: str, locale: str) -> str:
    """The first heading of the page the frontend should show (the locale's, else the English one)."""
    docs = shot.REPO / "web" / "docs"
    page = docs / node / f"{locale}.md"
    return (page if page.is_file() else docs / f"{node}.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--locale", default="en", help="frontend language (Comfy.Locale): en, zh, ...")
    ap.add_argument("--node", default="GenerateVideo")
    ap.add_argument("--front-end-root", help="a frontend build's static/ folder (default: the installed one)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=1000)
    ap.add_argument("--chromium")
    args = ap.parse_args(argv)

    from PIL import Image

    from support.comfy_host import ComfyServer

    chromium = shot.find_chromium(args.chromium)
    tmp = Path(tempfile.mkdtemp(prefix="lingbot-help-shot-"))
    extra = ["--front-end-root", args.front_end_root] if args.front_end_root else []
    server = ComfyServer(tmp / "server", extra_args=extra, websocket=False)
    proc = log = cdp = None
    ok = False
    try:
        server.start()
        status, _ = server.post("/settings", shot.build_settings_payload({"Comfy.Locale": args.locale}))
        if status != 200:
            raise RuntimeError(f"POST /settings answered {status}")
        proc, log, cdp = shot.launch_chromium(chromium, tmp / "profile", args.width, args.height)
        cdp.call("Emulation.setDeviceMetricsOverride", width=args.width, height=args.height,
                 deviceScaleFactor=1, mobile=False)
        cdp.call("Page.enable")
        cdp.call("Runtime.enable")
        cdp.call("Page.addScriptToEvaluateOnNewDocument", source=shot.PRELOAD + PRELOAD)
        cdp.call("Page.navigate", url=server.url + "/")
        shot.wait_for(cdp, shot.APP_READY, 120, "the ComfyUI app")
        time.sleep(2.0)
        for _ in range(2):
            cdp.key("Escape", "Escape", 27)
            cdp.evaluate(shot.DISMISS)
        version = cdp.evaluate("window.__COMFYUI_FRONTEND_VERSION__ || null")
        node = json.dumps(args.node)
        zh = json.loads((shot.REPO / "locales" / "zh" / "nodeDefs.json").read_text(encoding="utf-8"))
        first_input = next(iter(zh.get(args.node, {}).get("inputs", {})), "")
        titles = cdp.evaluate(PLACE % {"node": node})
        time.sleep(1.0)  # the selection toolbox appears after the selection
        display = shot.wait_for(cdp, OPEN_HELP % {"node": node}, 15, "the selection toolbox's info button")
        try:
            heading = shot.wait_for(cdp, HELP_SHOWN % {"title": json.dumps(page_title(args.node, args.locale))},
                                30, "the help page")
        except TimeoutError:
            heading = None  # screenshot what is shown instead, and fail
        time.sleep(1.0)
        cdp.evaluate(shot.DISMISS)
        result = {"frontend": version, "locale": args.locale, "canvas_titles": titles,
                  "help_headings": heading, "help_fetches": cdp.evaluate(HELP_FETCHES),
                  "input_tooltip": cdp.evaluate(TOOLTIP % {"node": node, "input": json.dumps(first_input)}), "node_display_name": display}
        png = cdp.call("Page.captureScreenshot", format="png")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Image.open(io.BytesIO(base64.b64decode(png["data"]))).convert("RGB").save(args.out, optimize=True)
        result["out"] = str(args.out)
        print(json.dumps(result, ensure_ascii=False), flush=True)
        ok = heading is not None
    finally:
        shot.close_browser(proc, log, cdp)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
