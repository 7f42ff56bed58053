"""LingBot-Video Multi-GPU in the session's real ComfyUI (CPU): the loader's pipeline in 2 worker processes
(gloo ranks, CFG split), against the same graph in ComfyUI's own process.

The workers are found by scanning /proc for children of the server process running the worker module.
The tests run in order on one aliased package (its own loader key, so nothing is shared with other modules)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from support.comfy_graphs import (
    EXAMPLE_IMAGE, EXAMPLES, H, W, alias_package, generate, loader, node_files, save_image, saved_frames, widget_inputs,
)
from support.comfy_host import execution_error, progress_events, ws_events
from support.worker_processes import rss_mib, worker_pids as workers_of

pytestmark = pytest.mark.comfy

MODEL = "lingbot-mgpu-dense"


def multi_gpu(gpus: str = "2") -> dict:
    return {"class_type": "LingbotMultiGPU", "inputs": {"gpus": gpus, "cfg_degree": 2, "context_degree": 0,
                                                        "fsdp": False, "fsdp_text_encoder": False}}


def ti2v(prefix: str, parallel: bool, **gen) -> dict:
    graph = {
        "1": loader(MODEL, offload="none"),
        "5": {"class_type": "LoadImage", "inputs": {"image": EXAMPLE_IMAGE}},
        "2": {"class_type": "EncodeImageVAE", "inputs": {"pipe": ["1", 0], "image": ["5", 0], "width": W, "height": H}},
        "3": generate("1", cond="2", **gen),
        "6": save_image("3", prefix),
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 1], "filename_prefix": f"latents/{prefix}"}},
    }
    if parallel:
        graph["7"] = multi_gpu()
        graph["1"]["inputs"]["multi_gpu"] = ["7", 0]
    return graph


def t2v(prefix: str, **gen) -> dict:
    graph = {"7": multi_gpu(), "1": loader(MODEL, offload="none", multi_gpu=["7", 0]), "3": generate("1", **gen),
             "6": save_image("3", prefix)}
    return graph


def saved_latent(server, entry) -> np.ndarray:
    from safetensors.numpy import load_file

    (path,) = node_files(server, entry, "8")
    return load_file(str(path))["latent_tensor"]


def wait_progress(server, prompt_id: str, node: str, at_least: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not [e for e in server._ws.events_for(prompt_id) if e["type"] == "progress"
               and e["data"].get("node") == node and e["data"].get("value", 0) >= at_least]:
        assert time.monotonic() < deadline, f"node {node} reported no progress:\n{server.log_tail(40)}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(comfy_server, packages):
    comfy_server.add_input(EXAMPLES / EXAMPLE_IMAGE)
    alias_package(comfy_server, packages, "dense", MODEL)
    yield comfy_server
    comfy_server.free(settle=2)  # no worker is left for the other modules
    assert workers_of(comfy_server.proc.pid) == set()


def test_the_node_and_the_loader_input_are_listed_with_tooltips(server):
    info = server.object_info("LingbotMultiGPU")
    assert info["category"] == "LingBot-Video" and info["description"] and info["output"] == ["LINGBOT_MULTI_GPU"]
    assert info["display_name"] == "LingBot-Video Multi-GPU"
    inputs = widget_inputs(info)
    assert set(inputs) == {"gpus", "cfg_degree", "context_degree", "fsdp", "fsdp_text_encoder"}
    assert all(spec[1].get("tooltip") for spec in inputs.values())
    load = server.object_info("LoadLingbotPipeline")["input"]["optional"]["multi_gpu"]
    assert load[0] == "LINGBOT_MULTI_GPU" and load[1]["tooltip"]


def test_two_workers_give_the_frames_of_one_process_and_unload_stops_them(server):
    pid = server.proc.pid
    single = server.run(ti2v("mgpu_single", parallel=False, seed=5))
    assert workers_of(pid) == set()
    rss_before_workers = rss_mib(pid)
    started = time.monotonic()
    multi = server.run(ti2v("mgpu_multi", parallel=True, seed=5))
    first_run_s = time.monotonic() - started
    workers = workers_of(pid)
    assert len(workers) == 2, workers
    a, b = saved_frames(server, single, "6"), saved_frames(server, multi, "6")
    assert a.shape == b.shape == (5, H, W, 3)
    assert np.abs(a.astype(int) - b.astype(int)).max() == 0
    la, lb = saved_latent(server, single), saved_latent(server, multi)
    assert la.shape == lb.shape and np.abs(la - lb).max() <= 1e-5
    assert [e["value"] for e in progress_events(multi, "3")][-1] == 3  # the bar reached the last step

    # Kept across prompts: another seed runs in the same processes.
    started = time.monotonic()
    server.run(ti2v("mgpu_multi2", parallel=True, seed=6))
    warm_run_s = time.monotonic() - started
    assert workers_of(pid) == workers
    worker_rss = {w: rss_mib(w) for w in workers}
    rss_loaded = rss_mib(pid)

    unload = ti2v("mgpu_multi", parallel=True, seed=5)
    unload["9"] = {"class_type": "UnloadLingbotPipeline", "inputs": {"pipe": ["1", 0], "frames": ["3", 0]}}
    unload["10"] = save_image("9", "mgpu_after_unload")
    server.run(unload)
    assert workers_of(pid) == set() and not any(Path(f"/proc/{w}").exists() for w in workers)
    print(f"\nComfyUI RSS {rss_before_workers:.0f} MiB before the workers, {rss_loaded:.0f} with them, "
          f"{rss_mib(pid):.0f} after unload; worker RSS {sorted(round(v) for v in worker_rss.values())} MiB; "
          f"first multi-GPU prompt {first_run_s:.1f} s (starts the workers), a warm one {warm_run_s:.1f} s")


def test_cancel_stops_the_workers_run_and_the_next_prompt_runs(server):
    pid = server.proc.pid
    prompt_id = server.queue(t2v("mgpu_cancel", seed=11, steps=200))
    wait_progress(server, prompt_id, "3", 2)
    workers = workers_of(pid)
    server.interrupt(prompt_id)
    sent = time.monotonic()
    entry = server.wait(prompt_id, timeout=120)
    err = execution_error(entry)
    assert err is not None and err["_event"] == "execution_interrupted" and err["node_id"] == "3", err
    after = [e for e in ws_events(entry, "progress") if e["data"].get("node") == "3" and e["t"] > sent]
    assert len(after) <= 1, [e["data"]["value"] for e in after]
    assert len(progress_events(entry, "3")) < 200
    assert workers_of(pid) == workers  # the same ranks stopped together and stay usable
    done = server.run(t2v("mgpu_after_cancel", seed=12, steps=2))
    assert len(saved_frames(server, done, "6")) == 5 and workers_of(pid) == workers


def test_a_killed_worker_is_one_error_leaves_no_process_and_the_next_prompt_restarts_them(server):
    pid = server.proc.pid
    prompt_id = server.queue(t2v("mgpu_killed", seed=21, steps=200))
    wait_progress(server, prompt_id, "3", 2)
    workers = workers_of(pid)
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    entry = server.wait(prompt_id, timeout=120)
    err = execution_error(entry)
    assert err is not None and err["_event"] == "execution_error" and err["node_id"] == "3", err
    message = err["exception_message"]
    assert f"pid {victim}) was killed by signal SIGKILL" in message and "worker rank" in message, message
    assert "Traceback" not in message and message.count("\n") <= 1
    (event,) = [e for e in ws_events(entry) if e["type"] == "execution_error"]
    print(f"\nexecution_error {event['t'] - killed:.2f} s after the kill" if "t" in event else "")
    assert workers_of(pid) == set() and not any(Path(f"/proc/{w}").exists() for w in workers)

    done = server.run(t2v("mgpu_restarted", seed=22, steps=2))
    assert len(saved_frames(server, done, "6")) == 5
    again = workers_of(pid)
    assert len(again) == 2 and not again & workers

    server.free(settle=0)  # ComfyUI's 'Unload models' stops them too
    deadline = time.monotonic() + 30
    while workers_of(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers_of(pid) == set()
