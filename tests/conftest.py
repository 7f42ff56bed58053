"""Shared fixtures: tiny model packages written once per session, fresh pipelines per test."""

import os

from child_runs import prepare

prepare()  # offline by construction, before transformers/diffusers are imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

TINY = dict(height=64, width=96, num_frames=5, steps=3)


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
    from comfy_host import ComfyServer, comfyui_unavailable_reason

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
    from chat_server import ChatCompletionsServer

    server = ChatCompletionsServer().start()
    yield server
    server.stop()


# DiT configs for memory tests: few but wide layers, so writing the package is quick for its size.
MEMORY_DIT = {"hidden_size": 1536, "num_attention_heads": 12, "axes_dims": [32, 48, 48], "depth": 3,
              "intermediate_size": 6144}  # about 0.5 GiB per DiT in fp32
MEMORY_DIT_MEDIUM = {"hidden_size": 512, "num_attention_heads": 4, "axes_dims": [32, 48, 48], "depth": 2,
                     "intermediate_size": 2048}  # about 45 MiB per DiT


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
    accelerator, observed for the graphs of tests/inprocess_runner.py (one run per session)."""
    from comfy_host import comfyui_unavailable_reason
    from inprocess_runner import observations

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return observations(packages["dense"], tmp_path_factory.getbasetemp() / "inprocess")
