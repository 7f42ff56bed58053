"""The vendored reference vectors (tests/data/reference, from the reference implementation): their package, prompt
and first frame, and the tolerance the pack's numbers are held to."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image


TOL = 1e-5


REF = Path(__file__).resolve().parents[1] / "data" / "reference"


PACKAGE = REF / "package-dense"


PROMPT = (REF / "inputs" / "prompt.json").read_text(encoding="utf-8")


def vectors(name: str) -> dict:
    with np.load(REF / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def assert_matches(actual, expected, what: str) -> float:
    actual = actual.detach().cpu().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, reference {expected.shape}"
    delta = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) if expected.size else 0.0
    assert delta <= TOL, f"{what}: max |delta| {delta:.3g} > {TOL:g}"
    return delta


def first_frame() -> Image.Image:
    return Image.open(REF / "inputs" / "first_frame.png")
