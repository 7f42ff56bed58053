"""Run example_workflows/lingbot_ti2v_refine.json in a headless ComfyUI and collect the videos.

    scripts/demo                      # tiny random-weight MoE fixture, small sizes (CPU, about a minute)
    scripts/demo --model-dir PATH     # real MoE package (with refiner/): the workflow's own sizes
    scripts/demo --cpu                # force ComfyUI onto the CPU even where CUDA is available

Steps: write (or link) the model package, start ComfyUI through tests/comfy_host.ComfyServer with
this pack linked on an empty input folder (the pack places the example image there itself, as on a
user's fresh install: nodes/example_inputs.py), convert the UI workflow to an API prompt, shrink sizes/steps (fixture only), run it, copy the mp4s to out/demo/, decode the refined
mp4 with PyAV and write a contact sheet PNG. Re-running overwrites everything in out/demo/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.comfy_host import ComfyServer, PromptExecutionError, workflow_to_api  # noqa: E402

WORKFLOW = REPO / "example_workflows" / "lingbot_ti2v_refine.json"
INPUT_IMAGE = "lingbot_example_input.png"
#: ComfyUI's own optional nodes that fail to import here, and why that is expected.
EXPECTED_IMPORT_FAILURES = {
    "nodes_audio": "needs torchaudio, which scripts/setup-env leaves out on purpose (no LingBot node uses audio)",
    "nodes_audio_encoder": "needs torchaudio (left out on purpose, as above)",
}
FIXTURE_NAME = "lingbot-tiny-moe"

# Fixture sizes: small enough for a CPU, big enough to see something (base 96x160, refined 2x).
TINY_BASE = dict(height=96, width=160, num_frames=9, steps=4)
TINY_REFINE = dict(height=192, width=320, steps=4)


class DemoServer(ComfyServer):
    """The test harness's server, optionally without ``--cpu`` (real weights on a GPU)."""

    def __init__(self, *args, cpu: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu = cpu

    def command(self) -> list[str]:
        cmd = super().command()
        return cmd if self.cpu else [c for c in cmd if c != "--cpu"]


def _nodes(api: dict, class_type: str) -> list[str]:
    return [nid for nid, node in api.items() if node["class_type"] == class_type]


def _set(api: dict, class_type: str, **values) -> None:
    ids = _nodes(api, class_type)
    if not ids:
        raise SystemExit(f"demo: {WORKFLOW.name} has no {class_type} node")
    for nid in ids:
        api[nid]["inputs"].update(values)


def _decode(path: Path):
    import av
    import numpy as np

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        rate = stream.average_rate
    return frames, rate


def _explain_import_failures(log_path: Path) -> None:
    """Say, next to ComfyUI's own "IMPORT FAILED" lines, which are expected (torchaudio left out)."""
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if "IMPORT FAILED" not in line or "seconds" in line:
            continue  # the timing table repeats the same modules
        module = Path(line.split("IMPORT FAILED:", 1)[-1].strip()).name.removesuffix(".py")
        why = EXPECTED_IMPORT_FAILURES.get(module)
        if why:
            print(f"demo: ComfyUI's log says IMPORT FAILED for {module}: expected, it {why}")
        else:
            print(f"demo: ComfyUI's log says {line.strip()} (not expected: see {log_path})")


def _use_cpu(force_cpu: bool) -> bool:
    if force_cpu:
        return True
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a real LingBot-Video MoE package (model_index.json, refiner/)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo", help="output folder (default out/demo)")
    parser.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU even when CUDA is available")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the prompt (default 900 with the fixture, unlimited with --model-dir)")
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args.model_dir is not None:
        model_dir = args.model_dir.expanduser().resolve()
        if not (model_dir / "model_index.json").is_file():
            raise SystemExit(f"demo: {model_dir} has no model_index.json; point --model-dir at the package folder.")
        if not (model_dir / "refiner").is_dir():
            raise SystemExit(f"demo: {model_dir} has no refiner/; the refine workflow needs the MoE package "
                             "(robbyant/lingbot-video-moe-30b-a3b).")
        model_name = model_dir.name
        print(f"demo: real weights from {model_dir} (workflow sizes)")
    else:
        from lingbot_core.testing.fixtures import write_package

        model_name = FIXTURE_NAME
        model_dir = write_package(out / "models" / "diffusers" / FIXTURE_NAME, moe=True, fp32=True, seed=1)
        print(f"demo: tiny random-weight MoE fixture in {model_dir} (the video is noise, not a picture)")

    cpu = _use_cpu(args.cpu)
    server = DemoServer(None, models={model_name: model_dir}, cpu=cpu, startup_timeout=300)
    try:
        server.start()
        print(f"demo: ComfyUI {server.system_stats()['system']['comfyui_version']} on "
              f"{'CPU' if cpu else 'GPU'} at {server.url} ({server.startup_seconds:.1f} s to start)")
        _explain_import_failures(server.log_path)
        if not (server.input_dir / INPUT_IMAGE).is_file():
            print(server.log_tail(40), file=sys.stderr)
            raise SystemExit(f"demo: the pack did not place {INPUT_IMAGE} in {server.input_dir}: the example "
                             "workflows would fail on a fresh install (see nodes/example_inputs.py)")
        print(f"demo: the pack placed {INPUT_IMAGE} in ComfyUI's input folder")

        api = workflow_to_api(json.loads(WORKFLOW.read_text(encoding="utf-8")), server.object_info())
        _set(api, "LoadLingbotPipeline", model=model_name)
        if args.model_dir is None:
            _set(api, "GenerateVideo", **TINY_BASE)
            _set(api, "EncodeImageVAE", height=TINY_BASE["height"], width=TINY_BASE["width"])
            _set(api, "Refine", **TINY_REFINE)
        timeout = args.timeout or (900 if args.model_dir is None else 7 * 24 * 3600)

        t_run = time.monotonic()
        try:
            entry = server.run(api, timeout=timeout)
        except PromptExecutionError as e:
            print(server.log_tail(40), file=sys.stderr)
            raise SystemExit(f"demo: the workflow failed: {e}") from None
        run_s = time.monotonic() - t_run

        # Copy the videos under stable names (SaveVideo's filename_prefix without the counter).
        refine_id = _nodes(api, "Refine")[0]
        videos = {}
        for sid in _nodes(api, "SaveVideo"):
            (path,) = server.output_files({"outputs": {sid: entry["outputs"].get(sid, {})}})
            prefix = api[sid]["inputs"]["filename_prefix"].rstrip("/").split("/")[-1]
            dest = out / f"{prefix}.mp4"
            shutil.copyfile(path, dest)
            source = api[api[sid]["inputs"]["video"][0]]["inputs"]["images"][0]
            videos["refined" if source == refine_id else "base"] = dest
    finally:
        server.stop()

    from lingbot_core.files.video_io import contact_sheet, write_png

    sheet = None
    for label, path in sorted(videos.items()):
        frames, rate = _decode(path)
        print(f"demo: {label} video  {path}  ({frames.shape[0]} frames, {frames.shape[2]}x{frames.shape[1]}, {float(rate):g} fps)")
        if label == "refined":
            sheet = out / "ti2v_refined_contact_sheet.png"
            write_png(contact_sheet(frames.astype("float32") / 255.0, columns=5), sheet)
    print(f"demo: contact sheet {sheet}")
    print(f"demo: prompt ran in {run_s:.1f} s; wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
