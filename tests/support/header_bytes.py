"""One pipeline's weight bytes as the CPU loads an fp32 package ("auto" = fp32), counted independently
of the pack: every tensor's element count from the safetensors headers, read with the json module."""

import json
from pathlib import Path

import numpy as np


def fp32_weight_bytes(package: Path, transformer: str = "transformer") -> int:
    total = 0
    for sub in (transformer, "text_encoder", "vae"):
        for path in (Path(package) / sub).glob("*.safetensors"):
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            header.pop("__metadata__", None)
            total += sum(4 * int(np.prod(t["shape"])) for t in header.values())
    return total
