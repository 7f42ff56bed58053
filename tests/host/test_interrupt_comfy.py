"""Cancel (the ✕ in the queue: POST /interrupt) stops a running GenerateVideo at its next step, ends the
prompt as an interrupt, saves nothing, leaves nothing on the accelerator, and the next run works."""

import pytest

from support.comfy_host import execution_error, progress_events, ws_events

pytestmark = pytest.mark.comfy

DENSE = "lingbot-tiny-dense"


@pytest.fixture(scope="module")
def interrupts(packages, tmp_path_factory):
    from support.comfy_host import comfyui_unavailable_reason
    from support.interrupt_runner import observations

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return observations(packages["dense"], tmp_path_factory.mktemp("interrupts"))


@pytest.mark.parametrize("mode", ["model", "sequential", "block"])
def test_an_interrupt_ends_the_prompt_at_the_next_step_with_nothing_resident(interrupts, mode):
    from support.interrupt_runner import AT, STEPS

    run, again = interrupts[mode]["interrupted"], interrupts[mode]["again"]
    assert (run["status"], run["event"], run["node"]) == ("error", "execution_interrupted", "2"), run
    # Cancelled while step AT was reported: the step after it is where it stops (no step more).
    assert run["steps"] == list(range(1, AT + 1)), run["steps"]
    if mode == "model":  # the DiT stays on the accelerator between steps (sequential/block stream it per layer/block)
        assert run["resident_at_step"] == "transformer", run  # the tracker sees it while it samples...
    assert run["resident_at_end"] == "", run  # ...and nothing once the prompt was cancelled
    assert run["saved"] == []
    assert (again["status"], again["steps"], again["resident_at_end"]) == ("success", list(range(1, STEPS + 1)), "")
    assert len(again["saved"]) == 5  # 5 frames


def test_post_interrupt_stops_a_running_generate_within_one_step(comfy_server):
    """Through the HTTP route the browser's Cancel uses: at most the step in flight is reported after it."""
    import time

    graph = {"1": {"class_type": "LoadLingbotPipeline",
                   "inputs": {"model": DENSE, "transformer": "transformer", "offload": "model", "dit_precision": "auto",
                              "text_encoder_precision": "auto", "vae_precision": "fp32"}},
             "2": {"class_type": "GenerateVideo",
                   "inputs": {"pipe": ["1", 0], "prompt": "a red kite", "negative_prompt": "", "width": 96,
                              "height": 64, "num_frames": 5, "steps": 200, "guidance_scale": 3.0, "shift": 3.0,
                              "seed": 811}},
             "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "post_interrupt"}}}
    prompt_id = comfy_server.queue(graph)
    listener = comfy_server._ws
    assert listener is not None, "the session server records websocket events"
    deadline = time.monotonic() + 300
    while not [e for e in listener.events_for(prompt_id) if e["type"] == "progress"
               and e["data"].get("node") == "2" and e["data"].get("value", 0) >= 2]:
        assert time.monotonic() < deadline, "GenerateVideo reported no progress"
        time.sleep(0.02)
    comfy_server.interrupt(prompt_id)
    sent = time.monotonic()
    entry = comfy_server.wait(prompt_id, timeout=120)
    err = execution_error(entry)
    assert err is not None and err["_event"] == "execution_interrupted" and err["node_id"] == "2", err
    progress = [e for e in ws_events(entry, "progress") if e["data"].get("node") == "2"]
    after = [e for e in progress if e["t"] > sent]
    assert len(after) <= 1, [e["data"]["value"] for e in after]  # the step in flight, no more
    assert 2 <= len(progress_events(entry, "2")) < 200
    assert not list(comfy_server.output_dir.glob("post_interrupt*"))
