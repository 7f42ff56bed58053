#!/usr/bin/env python3
"""Check in a real browser that ComfyUI shows the pack's help pages and translations, and screenshot it.

    apt-get install -y chromium
    .venv/bin/python scripts/screenshot_help.py --locale zh --out /tmp/help_zh.png
    .venv/bin/python scripts/screenshot_help.py --locale en --front-end-root <frontend>/static --out /tmp/help_en.png

Starts a headless ComfyUI on CPU with this pack linked (``--front-end-root`` picks another frontend
build, e.g. from ``pip install --target DIR comfyui-frontend-package==X``), sets the frontend's language
(``Comfy.Locale``), places ``--node`` and LoadLingbotPipeline on the canvas, opens the node's help in the
node library panel (what the selection toolbox's info button does) and screenshots the window. Prints a
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
import subprocess
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
  app.canvas.ds.scale = 0.75; app.canvas.ds.offset = [20, 40];
  app.canvas.selectNode(node);
  app.canvas.setDirty(true, true);
  return app.graph._nodes.map(n => n.title);
})()"""

# Open the node library side panel and the node's help in it (the store the info button uses).
OPEN_HELP = """(() => {
  const pinia = document.querySelector('#vue-app').__vue_app__.config.globalProperties.$pinia;
  const tabs = window.app.extensionManager.sidebarTab;
  if (tabs.activeSidebarTabId !== 'node-library') tabs.toggleSidebarTab('node-library');
  const def = pinia._s.get('nodeDef').nodeDefsByName[%(node)s];
  setTimeout(() => pinia._s.get('nodeHelp').openHelp(def), 300);
  return def.display_name;
})()"""

HELP_SHOWN = """(() => {
  const h = [...document.querySelectorAll('h1')].map(e => e.textContent.trim());
  return h.find(t => t.includes(%(title)s)) || null;
})()"""

HELP_FETCHES = """performance.getEntriesByType('resource').map(e => e.name)
  .filter(n => n.includes('/docs/')).map(n => n.replace(location.origin, '') + '')"""


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
        cdp.call("Page.addScriptToEvaluateOnNewDocument", source=shot.PRELOAD)
        cdp.call("Page.navigate", url=server.url + "/")
        shot.wait_for(cdp, shot.APP_READY, 120, "the ComfyUI app")
        time.sleep(2.0)
        for _ in range(2):
            cdp.key("Escape", "Escape", 27)
            cdp.evaluate(shot.DISMISS)
        version = cdp.evaluate("window.__COMFYUI_FRONTEND_VERSION__ || null")
        node = json.dumps(args.node)
        titles = cdp.evaluate(PLACE % {"node": node})
        display = cdp.evaluate(OPEN_HELP % {"node": node})
        heading = shot.wait_for(cdp, HELP_SHOWN % {"title": json.dumps(display)}, 30, "the help page")
        time.sleep(1.0)
        cdp.evaluate(shot.DISMISS)
        result = {"frontend": version, "locale": args.locale, "canvas_titles": titles,
                  "help_heading": heading, "help_fetches": cdp.evaluate(HELP_FETCHES)}
        png = cdp.call("Page.captureScreenshot", format="png")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Image.open(io.BytesIO(base64.b64decode(png["data"]))).convert("RGB").save(args.out, optimize=True)
        result["out"] = str(args.out)
        print(json.dumps(result, ensure_ascii=False), flush=True)
    finally:
        if cdp is not None:
            try:
                cdp.call("Browser.close")
            except Exception:  # noqa: BLE001 - the process is ended below anyway
                pass
            cdp.close()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not None:
            log.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
