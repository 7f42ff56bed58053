#!/usr/bin/env python3
"""Screenshot an example workflow opened in the ComfyUI web frontend (for the README).

Regenerate the README image (from the repository root, after ``scripts/setup-env``)::

    apt-get install -y chromium        # Debian/Ubuntu; any Chrome/Chromium binary works (--chromium)
    .venv/bin/python scripts/screenshot_workflow.py
    # -> docs/images/workflow_ti2v_refine.png

Template-browser thumbnails (ComfyUI fetches ``example_workflows/<name>.jpg``), one per workflow::

    for w in lingbot_t2v lingbot_ti2v lingbot_ti2v_refine lingbot_prose_ti2v_refine lingbot_remote_t2v \
             lingbot_moe_4step_lora lingbot_moe_dmd_8step lingbot_moe_gguf_4step_lora; do
        .venv/bin/python scripts/screenshot_workflow.py --workflow example_workflows/$w.json \
            --out example_workflows/$w.jpg --width 1024 --height 768 --out-width 512
    done

What it does:

1. writes tiny fixture model packages (``lingbot_core.testing.fixtures.write_package``) named
   ``lingbot-video-moe-30b-a3b`` and ``lingbot-video-dense-1.3b`` so the loaders' ``model``
   dropdowns hold the names the workflow uses, and copies the workflow's input image;
2. starts a headless ComfyUI on CPU with this pack linked (``tests/comfy_host.ComfyServer``), and
   pre-sets a few frontend settings (no first-run templates dialog, no minimap, text drawn at every
   zoom level);
3. launches headless Chromium and drives it over the Chrome DevTools protocol (standard library
   only: no Playwright, no Selenium): opens the app, ``app.loadGraphData(workflow)``, dismisses
   dialogs and toasts, fits the whole graph into the free part of the canvas, and screenshots it;
4. renders at ``--supersample`` x the pixel density and downsizes to the viewport size with PIL
   (crisper small text than a 1x render), then saves an optimized PNG.

``--layout out.json`` also writes the frontend's own layout of every node (stored size, the size it
computes from slots and widgets, each widget's row): the figures ``tests/support/workflow_geometry.py`` is
calibrated on.

Everything runs in a temporary directory that is removed at the end (``--keep-temp`` keeps it,
with ComfyUI's log).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from support.comfy_host import ws_frame, ws_read_frame  # noqa: E402  (stdlib-only websocket framing)

DEFAULT_WORKFLOW = REPO / "example_workflows" / "lingbot_ti2v_refine.json"
DEFAULT_OUT = REPO / "docs" / "images" / "workflow_ti2v_refine.png"
MODELS = {"lingbot-video-moe-30b-a3b": True, "lingbot-video-dense-1.3b": False,
          "lingbot-video-moe-dmd-30b-a3b": True}  # name -> moe

#: Frontend settings written to the server's user settings before the page loads.
FRONTEND_SETTINGS = {
    "Comfy.TutorialCompleted": True,          # no "templates" dialog on first start
    "Comfy.Minimap.Visible": False,           # the minimap would cover part of the graph
    "LiteGraph.Canvas.MinFontSizeForLOD": 0,  # draw titles/widgets at any zoom (no LOD boxes)
    "Comfy.Workflow.ShowMissingModelsWarning": False,
    "Comfy.Workflow.ShowMissingNodesWarning": False,
    "Comfy.Graph.CanvasInfo": False,          # no "T: / I: / N: / FPS" overlay
    "Comfy.Workflow.Persist": False,          # a reload opens no earlier tabs (--all loads one per page)
}

#: Run in the page before the app's scripts: dismiss the "Introducing Nodes 2.0" banner (kept in
#: localStorage by the frontend, not in the server-side settings).
PRELOAD = "try { localStorage.setItem('vueNodesBannerDismissed', 'true'); } catch (e) {}"

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
    "--remote-debugging-port=0", "--remote-allow-origins=*",
]


def find_chromium(explicit: str | None) -> str:
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("no Chromium/Chrome found; install one (e.g. apt-get install -y chromium) "
             "or pass --chromium /path/to/binary")


# --------------------------------------------------------------------------------------------
# A minimal Chrome DevTools protocol client (RFC 6455 websocket, client side, stdlib only)
# --------------------------------------------------------------------------------------------

class CDP:
    def __init__(self, ws_url: str, timeout: float = 60.0):
        url = urllib.parse.urlparse(ws_url)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((
            f"GET {url.path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools handshake failed: {head[:200]!r}")
        self.next_id = 0
        self.events: list[dict] = []

    def _recv_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ConnectionError("DevTools connection closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        self.sock.sendall(ws_frame(opcode, payload))

    def _recv_message(self) -> dict:
        parts: list[bytes] = []
        while True:
            opcode, fin, data = ws_read_frame(self._recv_exact)
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the websocket")
            if opcode == 0x9:
                self._send_frame(0xA, data)
                continue
            if opcode in (0x0, 0x1, 0x2):
                parts.append(data)
                if fin:
                    return json.loads(b"".join(parts))

    def call(self, method: str, **params):
        self.next_id += 1
        msg_id = self.next_id
        self._send_frame(0x1, json.dumps({"id": msg_id, "method": method,
                                          "params": params}).encode())
        while True:
            msg = self._recv_message()
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def evaluate(self, expression: str, await_promise: bool = True):
        res = self.call("Runtime.evaluate", expression=expression, awaitPromise=await_promise,
                        returnByValue=True)
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise RuntimeError(f"page script failed: {text}")
        return res.get("result", {}).get("value")

    def key(self, key: str, code: str, key_code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=code,
                      windowsVirtualKeyCode=key_code, nativeVirtualKeyCode=key_code)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def wait_for(cdp: CDP, expression: str, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cdp.evaluate(expression)
        except RuntimeError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def launch_chromium(binary: str, profile: Path, width: int, height: int):
    profile.mkdir(parents=True, exist_ok=True)
    log = open(profile.parent / "chromium.log", "wb")
    proc = subprocess.Popen(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
         "about:blank"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.is_file() and port_file.read_text().strip()):
        if proc.poll() is not None:
            raise RuntimeError(f"Chromium exited with {proc.returncode}; see {log.name}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("Chromium did not open its DevTools port")
        time.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
        targets = json.load(resp)
    page = next(t for t in targets if t.get("type") == "page")
    return proc, log, CDP(page["webSocketDebuggerUrl"])


def close_browser(proc, log, cdp) -> None:
    """Close Chromium (politely, then by force) and its log; any argument may be None."""
    if cdp is not None:
        try:
            cdp.call("Browser.close")
        except Exception:  # noqa: BLE001 - fall back to terminating the process
            pass
        cdp.close()
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if log is not None:
        log.close()


# --------------------------------------------------------------------------------------------
# Page scripts
# --------------------------------------------------------------------------------------------

# Load the workflow (saved under the user's workflows/ before the page loaded) as a tab named
# after the file, then close every other tab (the default "Unsaved Workflow" opened on start).
LOAD = """(async () => {
  const app = window.app, store = app.extensionManager.workflow;
  await store.syncWorkflows();
  await app.loadGraphData(%(workflow)s, true, true, %(name)s, %(options)s);
  const active = store.activeWorkflow;
  for (const w of [...store.openWorkflows]) if (w !== active) await store.closeWorkflow(w);
  return store.openWorkflows.map(w => ({path: w.path, persisted: w.isPersisted,
                                         modified: w.isModified}));
})()"""

APP_READY = """(() => {
  const app = window.app;
  return !!(app && app.graph && app.canvas && app.canvas.ds && app.canvas.canvas
            && document.querySelector('canvas') && app.extensionManager);
})()"""

DISMISS = """(() => {
  const sel = ['.p-toast-close-button', '.p-dialog-close-button', '.p-dialog-header-close'];
  let n = 0;
  for (const s of sel) for (const el of document.querySelectorAll(s)) { el.click(); n++; }
  return n;
})()"""

# Fit the whole graph (node boxes incl. titles, groups) into the part of the canvas that is not
# covered by the menu bar, side toolbar or the canvas controls, with a margin; returns the layout.
FIT = """(() => {
  const app = window.app, c = app.canvas, el = c.canvas;
  const r = el.getBoundingClientRect();
  // free area: start under/right of any fixed UI overlapping the canvas edges
  let top = r.top, left = r.left, right = r.right, bottom = r.bottom;
  const probe = (x, y) => {
    const hit = document.elementFromPoint(x, y);
    return hit && hit !== el && !el.contains(hit) ? hit.getBoundingClientRect() : null;
  };
  for (let x = r.left + 10; x < r.right; x += 40) {       // top bar(s)
    const b = probe(x, r.top + 5); if (b && b.height < r.height / 3) top = Math.max(top, b.bottom);
  }
  // floating bars near the top (the Run action bar, the workflow name): not the graph's own DOM widgets
  for (let y = r.top + 5; y < r.top + 120; y += 10) for (let x = r.left + 10; x < r.right; x += 40) {
    const hit = document.elementFromPoint(x, y);
    if (!hit || hit === el || el.contains(hit) || hit.closest('.dom-widget')) continue;
    const b = hit.getBoundingClientRect();
    if (b.height < r.height / 3 && b.width < r.width / 2 && b.top < r.top + 120) top = Math.max(top, b.bottom);
  }
  for (let y = top + 10; y < r.bottom; y += 40) {           // left toolbar
    const b = probe(r.left + 5, y); if (b && b.width < r.width / 4) left = Math.max(left, b.right);
  }
  for (let x = left + 10; x < r.right; x += 40) {          // bottom-right canvas controls
    const b = probe(x, r.bottom - 12);
    if (b && b.height < r.height / 4) bottom = Math.min(bottom, b.top);
  }
  const margin = %(margin)d;
  top += margin; left += margin; right -= margin; bottom -= margin;
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  const grow = (b) => { x0 = Math.min(x0, b[0]); y0 = Math.min(y0, b[1]);
                        x1 = Math.max(x1, b[0] + b[2]); y1 = Math.max(y1, b[1] + b[3]); };
  for (const n of app.graph._nodes) grow(n.getBounding());
  for (const g of (app.graph._groups || [])) grow(g._bounding || [g.pos[0], g.pos[1], g.size[0], g.size[1]]);
  const scale = Math.min((right - left) / (x1 - x0), (bottom - top) / (y1 - y0));
  const ds = c.ds;
  ds.scale = scale;
  // screen = (graph + offset) * scale, relative to the canvas element; centre the box
  const cx = (left + right) / 2 - r.left, cy = (top + bottom) / 2 - r.top;
  ds.offset[0] = cx / scale - (x0 + x1) / 2;
  ds.offset[1] = cy / scale - (y0 + y1) / 2;
  c.setDirty(true, true);
  c.draw(true, true);
  return {scale, box: [x0, y0, x1, y1], free: [left, top, right, bottom],
          nodes: app.graph._nodes.length};
})()"""


# The frontend's own layout of every node after drawing (for tests/host/test_example_workflows.py's
# calibration): stored size, the size the frontend computes from slots and widgets, and where each
# widget was drawn (y from the node's top, below the title).
LAYOUT = """(() => {
  const LG = window.LiteGraph || {};
  return {
    title_height: LG.NODE_TITLE_HEIGHT, slot_height: LG.NODE_SLOT_HEIGHT,
    widget_height: LG.NODE_WIDGET_HEIGHT, font: LG.NODE_TEXT_SIZE,
    textareas: [...document.querySelectorAll('textarea')].map(t => {
      const cs = getComputedStyle(t), ctx = document.createElement('canvas').getContext('2d');
      ctx.font = cs.font;
      const c = window.app.canvas, r = c.canvas.getBoundingClientRect(), s = c.ds.scale, o = c.ds.offset;
      const b = t.getBoundingClientRect();
      return {font: cs.font, padding: [cs.paddingLeft, cs.paddingRight], width: t.clientWidth,
              line: cs.lineHeight, box: [(b.left - r.left) / s - o[0], (b.top - r.top) / s - o[1],
                                         (b.right - r.left) / s - o[0], (b.bottom - r.top) / s - o[1]],
              char_width: ctx.measureText('x'.repeat(100)).width / 100,
              text: t.value.slice(0, 40)};
    }),
    scale: window.app.canvas.ds.scale, offset: [...window.app.canvas.ds.offset],
    // Nodes 2.0 draws each node as a DOM element: its box and its rows, in graph units (as pos/size)
    dom: (() => {
      const c = window.app.canvas, r = c.canvas.getBoundingClientRect(), s = c.ds.scale, o = c.ds.offset;
      const box = (b) => [(b.left - r.left) / s - o[0], (b.top - r.top) / s - o[1],
                          (b.right - r.left) / s - o[0], (b.bottom - r.top) / s - o[1]];
      return [...document.querySelectorAll('[data-node-id]')].map(el => ({
        id: el.dataset.nodeId, box: box(el.getBoundingClientRect()),
        widgets: [...el.querySelectorAll('.lg-node-widget, [data-widget-name], textarea')].map(w => ({
          name: w.dataset?.widgetName || w.getAttribute('aria-label') || w.tagName,
          cls: String(w.className).slice(0, 80), box: box(w.getBoundingClientRect()),
          rows: w.tagName === 'TEXTAREA' ? Math.floor(w.clientHeight / parseFloat(getComputedStyle(w).lineHeight || 12)) : null,
          line: w.tagName === 'TEXTAREA' ? getComputedStyle(w).lineHeight : null})),
      }));
    })(),
    nodes: window.app.graph._nodes.map(n => ({
      id: n.id, type: n.type, pos: [...n.pos], size: [...n.size],
      computed: n.computeSize ? [...n.computeSize()] : null,
      inputs: (n.inputs || []).map(i => ({name: i.name, widget: !!i.widget})),
      outputs: (n.outputs || []).length,
      widgets: (n.widgets || []).map(w => ({name: w.name, type: w.type, y: w.y ?? w.last_y,
        h: w.computedHeight ?? (w.computeSize ? w.computeSize(n.size[0])[1] : null)})),
    })),
  };
})()"""


def build_settings_payload(extra: dict | None = None) -> dict:
    payload = dict(FRONTEND_SETTINGS)
    payload.update(extra or {})
    return payload


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workflow", type=Path, default=DEFAULT_WORKFLOW)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--all", action="store_true",
                    help="every example_workflows/*.json, each to example_workflows/<name>.jpg (or <--out-dir>/<name>"
                         "<--suffix>), one server and browser for all; --workflow/--out are ignored")
    ap.add_argument("--out-dir", type=Path, help="with --all: the folder for the images (default example_workflows)")
    ap.add_argument("--suffix", default=".jpg", help="with --all: the image file ending (default .jpg)")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--supersample", type=int, default=2,
                    help="render at this device scale factor, then downsize (default 2; 1 = none)")
    ap.add_argument("--margin", type=int, default=16, help="CSS px around the fitted graph")
    ap.add_argument("--as-opened", action="store_true",
                    help="keep the view the frontend chose on opening (the workflow's stored extra.ds, or its own "
                         "fit) instead of fitting the graph: what a user sees first")
    ap.add_argument("--as-template", action="store_true",
                    help="with --as-opened: open the workflow as the template browser does (1.58.1 fits the graph)")
    ap.add_argument("--frontend-root", type=Path,
                    help="serve this frontend build (ComfyUI's --front-end-root), e.g. the static/ folder of "
                         "pip install --target DIR comfyui-frontend-package==1.58.1")
    ap.add_argument("--vue-nodes", action="store_true",
                    help="draw nodes with the Nodes 2.0 renderer (setting Comfy.VueNodes.Enabled, frontend >= 1.2x)")
    ap.add_argument("--chromium", help="Chromium/Chrome binary (default: found on PATH)")
    ap.add_argument("--colors", type=int, default=0,
                    help="quantize to this many colours to shrink the PNG (0 = lossless RGB)")
    ap.add_argument("--out-width", type=int, default=0,
                    help="downsize the saved image to this width, keeping the aspect (0 = --width)")
    ap.add_argument("--layout", type=Path,
                    help="also write the frontend's node layout (sizes, widget rows) as JSON here (with --all: a "
                         "folder, one <name>.json each)")
    ap.add_argument("--keep-temp", action="store_true", help="keep the temp dir (logs, profile)")
    return ap.parse_args(argv)


def jobs(args) -> list[tuple[Path, Path, Path | None]]:
    """(workflow, image, layout or None) for each screenshot asked for."""
    if not args.all:
        return [(args.workflow, args.out, args.layout)]
    out_dir = args.out_dir or REPO / "example_workflows"
    return [(wf, out_dir / f"{wf.stem}{args.suffix}", args.layout / f"{wf.stem}.json" if args.layout else None)
            for wf in sorted((REPO / "example_workflows").glob("*.json"))]


def shoot(cdp: CDP, server, workflow_path: Path, out: Path, layout_path: Path | None, args) -> None:
    """Open one workflow in the running app and save its screenshot (and layout)."""
    from PIL import Image

    workflow = json.loads(workflow_path.read_text())
    # Save the workflow as the user's workflows/<stem>.json so the app opens it as a saved
    # workflow (a tab named after the file, without the "unsaved" dot).
    saved = urllib.parse.quote(f"workflows/{workflow_path.stem}.json", safe="")
    status, _ = server.post(f"/userdata/{saved}?overwrite=true", workflow)
    if status != 200:
        raise RuntimeError(f"POST /userdata/{saved} answered {status}")
    # As the template browser opens it (frontend >= 1.5x then fits the graph, ignoring the stored view)
    options = json.dumps({"openSource": "template"} if args.as_template else {})
    tabs = cdp.evaluate(LOAD % {"workflow": json.dumps(workflow), "name": json.dumps(workflow_path.stem),
                                "options": options})
    print(f"[shot] open workflow tabs: {tabs}", flush=True)
    n_nodes = wait_for(cdp, "window.app.graph._nodes.length", 30, "the workflow's nodes")
    print(f"[shot] loaded {workflow_path.name}: {n_nodes} nodes", flush=True)
    time.sleep(1.5 if args.vue_nodes else 1.0)
    for _ in range(3):
        cdp.key("Escape", "Escape", 27)
        cdp.evaluate(DISMISS)
        time.sleep(0.3)
    # nothing selected, no hover state; then fit the graph ourselves (unless showing it as opened)
    cdp.evaluate("(() => { window.app.canvas.deselectAll?.(); return true; })()")
    if args.as_opened:
        view = cdp.evaluate("(() => ({scale: window.app.canvas.ds.scale, offset: [...window.app.canvas.ds.offset]}))()")
        print(f"[shot] as opened: {view}", flush=True)
        time.sleep(1.0)
    else:
        layout = cdp.evaluate(FIT % {"margin": args.margin})
        print(f"[shot] fitted: {layout}", flush=True)
        time.sleep(1.0)
        cdp.evaluate(DISMISS)
        cdp.evaluate(FIT % {"margin": args.margin})  # again, in case UI changed size meanwhile
        time.sleep(1.5 if args.vue_nodes else 1.0)

    if layout_path:
        layout_path.parent.mkdir(parents=True, exist_ok=True)
        layout_path.write_text(json.dumps(cdp.evaluate(LAYOUT), indent=1) + "\n")
        print(f"[shot] wrote the layout to {layout_path}", flush=True)

    shot = cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
    if image.size != (args.width, args.height):
        image = image.resize((args.width, args.height), Image.LANCZOS)
    if args.out_width and args.out_width != image.size[0]:
        image = image.resize((args.out_width, round(image.size[1] * args.out_width / image.size[0])), Image.LANCZOS)
    if args.colors:
        image = image.quantize(colors=args.colors, method=Image.MEDIANCUT, dither=Image.NONE)
    out.parent.mkdir(parents=True, exist_ok=True)
    jpeg = out.suffix.lower() in (".jpg", ".jpeg")
    image.save(out, optimize=True, **({"quality": 85} if jpeg else {}))
    print(f"[shot] wrote {out} ({image.size[0]}x{image.size[1]}, {out.stat().st_size / 1024:.0f} KiB)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from support.comfy_host import ComfyServer
    from lingbot_core.testing.fixtures import write_package

    chromium = find_chromium(args.chromium)
    tmp = Path(tempfile.mkdtemp(prefix="lingbot-shot-"))
    server = proc = log = cdp = None
    try:
        print(f"[shot] fixture packages in {tmp}", flush=True)
        models = {name: write_package(tmp / "models" / name, moe=moe, refiner=moe)
                  for name, moe in MODELS.items()}
        extra = ["--front-end-root", str(args.frontend_root.resolve())] if args.frontend_root else []
        # The input folder starts empty: the pack places the examples' image and video (nodes/example_inputs.py).
        server = ComfyServer(tmp / "server", models=models, extra_args=extra, env={"HF_HUB_OFFLINE": "1"},
                             websocket=False)
        server.start()
        print(f"[shot] ComfyUI at {server.url} (log {server.log_path})", flush=True)
        status, _ = server.post("/settings", build_settings_payload({"Comfy.VueNodes.Enabled": args.vue_nodes}))
        if status != 200:
            raise RuntimeError(f"POST /settings answered {status}")

        proc, log, cdp = launch_chromium(chromium, tmp / "chromium-profile", args.width, args.height)
        cdp.call("Emulation.setDeviceMetricsOverride", width=args.width, height=args.height,
                 deviceScaleFactor=args.supersample, mobile=False)
        cdp.call("Page.enable")
        cdp.call("Runtime.enable")
        cdp.call("Page.addScriptToEvaluateOnNewDocument", source=PRELOAD)
        for workflow, out, layout_path in jobs(args):
            # a fresh page for each workflow: the app is in the state a user opening it finds
            cdp.evaluate("(() => { try { localStorage.clear(); sessionStorage.clear(); } catch (e) {} return true; })()")
            cdp.call("Page.navigate", url=server.url + "/")
            time.sleep(0.5)
            wait_for(cdp, APP_READY, 120, "the ComfyUI app (window.app) to load")
            version = cdp.evaluate("window.__COMFYUI_FRONTEND_VERSION__ || null")
            print(f"[shot] frontend {version}{' (Nodes 2.0)' if args.vue_nodes else ''}", flush=True)
            time.sleep(1.5)  # let start-up extensions settle (first-run dialogs, etc.)
            for _ in range(2):
                cdp.key("Escape", "Escape", 27)
                cdp.evaluate(DISMISS)
            shoot(cdp, server, workflow, out, layout_path, args)
    finally:
        close_browser(proc, log, cdp)
        if server is not None:
            server.stop()
        if args.keep_temp:
            print(f"[shot] kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
