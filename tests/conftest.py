"""Shared fixtures: tiny model packages written once per session, fresh pipelines per test."""

import os

from support.child_runs import prepare

prepare()  # offline by construction, before transformers/diffusers are imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
from support.sizes import MEMORY_DIT, MEMORY_DIT_MEDIUM

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    """Tiny packages: fp32 dense, fp32 MoE (+ refiner), release-like bf16 dense, sharded MoE."""
    from lingbot_core.testing.fixtures import write_package

    root = tmp_path_factory.mktemp("packages")
    return {
        "dense": write_package(root / "lingbot-tiny-dense", fp32=True),
        "moe": write_package(root / "lingbot-tiny-moe", moe=True, fp32=True, seed=1),
        "dense_bf16": write_package(root / "lingbot-tiny-dense-bf16", seed=2),
        "moe_sharded": write_package(root / "lingbot-tiny-moe-sharded", moe=True, fp32=True, sharded=True, seed=1),
    }


@pytest.fixture(scope="session")
def broken_packages(tmp_path_factory):
    from lingbot_core.testing.fixtures import write_broken_packages

    return write_broken_packages(tmp_path_factory.mktemp("broken"))


@pytest.fixture(scope="module")
def dense(packages):
    """One dense pipeline per test module, for tests that do not change it (loading and releasing per test
    dominates their run time); ``dense_pipe`` is a fresh one per test."""
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["dense"], device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture
def dense_pipe(packages):
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["dense"], device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture
def moe_pipe(packages):
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["moe"], device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture
def refiner_pipe(packages):
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture(scope="session")
def test_image():
    """A deterministic 70x100 RGB float image in [0, 1] (not a multiple of anything, to exercise the crop)."""
    g = torch.Generator().manual_seed(123)
    return torch.rand(70, 100, 3, generator=g)


@pytest.fixture(scope="session")
def comfy_server(packages, tmp_path_factory):
    """One real headless ComfyUI (CPU) for the whole session, with the pack linked into custom_nodes/
    and the tiny fp32 packages in models/diffusers as "lingbot-tiny-dense" and "lingbot-tiny-moe".

    Skipped when no ComfyUI tree is available (scripts/setup-env installs one; or set COMFYUI_DIR).
    """
    from support.comfy_host import ComfyServer, comfyui_unavailable_reason

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    models = {"lingbot-tiny-dense": packages["dense"], "lingbot-tiny-moe": packages["moe"]}
    server = ComfyServer(tmp_path_factory.mktemp("comfy"), models=models)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chat_server():
    """A local OpenAI-compatible chat server (127.0.0.1 only) that records requests; see chat_server.py."""
    from support.chat_server import ChatCompletionsServer

    server = ChatCompletionsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def memory_packages(tmp_path_factory):
    """Dense packages (with a refiner) big enough to measure RSS with; deleted after the session."""
    import shutil

    from lingbot_core.testing.fixtures import write_package

    root = tmp_path_factory.mktemp("memory-packages")
    # fp32 on disk and on the CPU: no cast, so the weights stay memory-mapped (the path a release
    # package takes on a GPU in bf16); they count in the RSS once read, and must leave it on release.
    big = write_package(root / "lingbot-memory-big", fp32=True, seed=3, dit=MEMORY_DIT, refiner=False)
    # The refiner is a hard link to the base DiT: half the writing. Memory tests only need two
    # pipelines that are mapped separately; pages of a file mapped twice count twice in the RSS.
    (big / "refiner").mkdir()
    for f in (big / "transformer").iterdir():
        os.link(f, big / "refiner" / f.name)
    yield {
        "big": big,
        "medium": write_package(root / "lingbot-memory-medium", fp32=True, seed=4, dit=MEMORY_DIT_MEDIUM),
    }
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def inprocess_observations(packages, tmp_path_factory):
    """What ComfyUI's own executor, run in a child process with the residency tracker and the fake
    accelerator, observed for the graphs of tests/support/inprocess_runner.py (one run per session)."""
    from support.comfy_host import comfyui_unavailable_reason
    from support.inprocess_runner import observations

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return observations(packages["dense"], tmp_path_factory.getbasetemp() / "inprocess")


@pytest.fixture(scope="module")
def deep_package(tmp_path_factory):
    """The tiny fp32 dense package with a DEPTH-block DiT, so that K + 2 < depth (offload ``block``'s ring)."""
    from lingbot_core.testing.fixtures import dit_config, write_dit, write_package
    from support.sizes import DEPTH

    root = write_package(tmp_path_factory.mktemp("deep") / "lingbot-tiny-deep", fp32=True, refiner=False, seed=5)
    write_dit(root / "transformer", {**dit_config(False), "depth": DEPTH}, seed=5, fp32=True)
    return root
