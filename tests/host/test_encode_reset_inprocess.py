"""EncodeImageVAE's offload reset inside a real ComfyUI execution (ComfyUI 0.3.75's own executor).

The executor runs in a child process (``inprocess_runner.py``) with the residency tracker and the fake
accelerator (``cuda:3``) installed, so these tests see what a server subprocess cannot: which
components would be on the accelerator while each node computes, and where each stage asked its
inputs to go. Graphs, in ``model`` and ``sequential`` offload:

- ``a``: independent T2V and TI2V branches on one pipeline; 0.3.75 runs the whole T2V branch
  (text encoder, DiT, VAE decode) before the TI2V branch's EncodeImageVAE;
- ``b``: GenerateVideo -> its frames -> EncodeImageVAE -> GenerateVideo, one shared pipeline.

Marked ``comfy`` (deselect with ``-m "not comfy"``); the child run (about 20 s on 2 cores) is shared
with ``test_loader_links.py``.
"""

from __future__ import annotations

import pytest

from support.inprocess_runner import FRAMES, H, MODES, W

pytestmark = pytest.mark.comfy

# (graph, the encode node, the GenerateVideo that must have run before it, the one that consumes it)
GRAPHS = {"a": ("2", "4", "3"), "b": ("3", "2", "4")}
CASES = [(mode, graph) for mode in MODES for graph in GRAPHS]


@pytest.fixture(scope="module")
def runs(inprocess_observations):
    return inprocess_observations["encode"]


def resident_sets(snapshots, probe):
    """The resident sets seen by ``probe`` (counted snapshots ``"probe:comp,comp"``)."""
    return {key.split(":", 1)[1] for key in snapshots if key.split(":", 1)[0] == probe}


@pytest.mark.parametrize("mode,graph", CASES)
def test_graph_succeeds_and_saves_frames(runs, mode, graph):
    run = runs[mode][graph]
    assert run["status"] == "success", run["error"]
    saves = [nid for nid, cls in run["class_types"].items() if cls == "SaveImage"]
    assert sorted(run["frames"]) == sorted(saves)
    for nid in saves:
        assert run["frames"][nid] == [[W, H]] * FRAMES, nid


@pytest.mark.parametrize("graph", GRAPHS)
def test_same_frames_in_model_and_sequential_offload(runs, graph):
    """Same graph, same seeds: the offload mode (and the instrumentation) changes no pixel."""
    digests = {mode: runs[mode][graph]["digests"] for mode in MODES}
    assert all(len(d) == 2 and all(len(v) == FRAMES for v in d.values()) for d in digests.values()), digests
    assert digests["model"] == digests["sequential"]
    first, second = digests["model"].values()
    assert first != second  # the T2V and TI2V videos differ


@pytest.mark.parametrize("mode,graph", CASES)
def test_encode_runs_after_a_complete_generate(runs, mode, graph):
    run = runs[mode][graph]
    encode, before, after = GRAPHS[graph]
    order = run["executed"]
    assert encode in order and before in order and after in order, order  # all executed, none cached
    assert order.index(before) < order.index(encode) < order.index(after), order
    # The earlier GenerateVideo really used the pipeline: the DiT computed and the VAE decoded.
    seen = run["nodes"][before]["snapshots"]
    assert any(k.startswith("DiT:") for k in seen) and any(k.startswith("VAE.dec:") for k in seen), seen


@pytest.mark.parametrize("mode,graph", CASES)
def test_only_the_vae_is_resident_during_the_encode(runs, mode, graph):
    encode = GRAPHS[graph][0]
    snapshots = runs[mode][graph]["nodes"][encode]["snapshots"]
    # The encoder computes with exactly the VAE on the accelerator (the DiT and TE were evicted). Under
    # 'sequential' too: the VAE is placed whole, as under 'model' (streaming it per layer cost a copy of its
    # weights for every latent frame of every tile), so no weight streams in during the encode.
    assert resident_sets(snapshots, "VAE.enc") == {"vae"}, snapshots
    assert resident_sets(snapshots, "stream") == set(), snapshots
    assert not any(k.startswith(("TE:", "DiT:", "VAE.dec:")) for k in snapshots), snapshots


@pytest.mark.parametrize("mode,graph", CASES)
def test_nothing_is_resident_after_the_encode_or_any_node(runs, mode, graph):
    run = runs[mode][graph]
    encode = GRAPHS[graph][0]
    assert run["nodes"][encode]["resident_after"] == ""
    left = {nid: seg["resident_after"] for nid, seg in run["nodes"].items() if seg["resident_after"]}
    assert left == {}, f"components left on the accelerator after nodes: {left}"


@pytest.mark.parametrize("mode,graph", CASES)
def test_encode_inputs_go_to_the_hooks_execution_device(runs, mode, graph):
    encode = GRAPHS[graph][0]
    placements = runs[mode][graph]["nodes"][encode]["placements"]
    assert placements.get("vae_encode") == ["cuda:3"], placements
