"""Checkpoint files: the one place that reads weight files and their small JSON companions.

Safetensors headers (validated against the file size), tensor readers (memory-mapped or into a reused
buffer), a component's file list (single file or the shards of an index; pickles refused), its
``config.json``, and one checkpoint tensor read again for a LoRA restore. Nothing here builds a model,
so every other module may import it; it imports only :mod:`lingbot_core.files.fp8` (the checkpoint's fp8
scale convention).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict

import torch

from .fp8 import checkpoint_scale, dequantize, is_fp8, scale_name

MIB = 1024 ** 2
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * MIB  # a header lists tensors: even a 30B checkpoint's is a few MB


def is_safetensors(path) -> bool:
    """The one rule for what is a safetensors file by name: ``.safetensors`` in any case (ComfyUI lists
    ``X.SAFETENSORS`` too, and Windows and macOS do not tell the cases apart)."""
    return Path(path).suffix.lower() == ".safetensors"


def is_pickle(path) -> bool:
    return Path(path).suffix.lower() in PICKLE_SUFFIXES


class ModelPackageError(ValueError):
    """A model folder that is missing a component or holds invalid weights; the message says which."""


def read_config(folder: Path, component: str) -> dict:
    """A component's ``config.json``, with an error naming the component when it is missing or broken."""
    config_path = Path(folder) / "config.json"
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelPackageError(f"{component}: {config_path} is missing.") from None
    except ValueError as e:
        raise ModelPackageError(f"{component}: {config_path} is not valid JSON ({e}).") from None


def safetensors_files(folder: Path, component: str, stem: str) -> list:
    """The safetensors files of a component (single file or the shards of an index); refuses pickles."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelPackageError(f"{component}: {index.name} is not a valid safetensors index ({e}).") from None
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not is_safetensors(f) or f.parent != folder:
                raise ModelPackageError(f"{component}: the index names {f.name}, which is not a safetensors file in {folder}.")
            if not f.is_file():
                raise ModelPackageError(f"{component}: shard {f.name} listed in {index.name} is missing from {folder}.")
        return files
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.iterdir() if is_safetensors(p) and p.is_file())
    if found:
        return [folder / n for n in found]
    pickles = sorted(p.name for p in folder.iterdir() if is_pickle(p))
    if pickles:
        raise ModelPackageError(
            f"{component}: {folder} holds only pickle weights ({', '.join(pickles)}); they are refused because loading "
            "them can run arbitrary code. Download the .safetensors files of the release instead."
        )
    raise ModelPackageError(f"{component}: no .safetensors weights found in {folder}.")


def _read_header(path: Path):
    """``(size of the file, header length, {name: info})`` with every field checked: the tensor table
    is a JSON object of objects with a known dtype, a shape that is a list of sizes, and offsets that
    match them and tile the data exactly (:func:`_check_layout`). ModelPackageError names the file and
    what is wrong. Every safetensors file the pack opens passes here first (package, single file, LoRA)."""
    name = path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelPackageError(f"{name} is not a safetensors file (too short); download it again.")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ModelPackageError(f"{name} has a header larger than the file; it may be truncated, download it again.")
        if n > MAX_HEADER_BYTES:
            raise ModelPackageError(f"{name} announces a safetensors header of {n:,} bytes, which no checkpoint has; "
                                    "the file is not a valid safetensors file.")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        why = "it is nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise ModelPackageError(f"{name} has an invalid safetensors header ({why}); download it again.") from None
    if not isinstance(header, dict):
        raise ModelPackageError(f"{name}: the safetensors header is a JSON {type(header).__name__}, not an object "
                                "of tensors; the file is not a valid safetensors file.")
    header.pop("__metadata__", None)
    for key, info in header.items():
        def bad(what: str) -> ModelPackageError:
            return ModelPackageError(f"{name}: tensor {key[:200]!r} {what} in the safetensors header; the file is "
                                     "damaged or not a safetensors file, download it again.")

        if not isinstance(info, dict):
            raise bad(f"is described by a JSON {type(info).__name__}, not an object")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise bad(f"has unsupported dtype {str(info.get('dtype'))[:40]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"has shape {str(shape)[:60]!r}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise bad(f"has data_offsets {str(offsets)[:60]!r}, not [begin, end]")
    _check_layout(name, header, size - 8 - n)
    return size, n, header


def _check_layout(name: str, header: Dict[str, dict], data_bytes: int) -> None:
    """The tensors' byte ranges, sorted by offset, must tile the data section exactly: each begins where
    the previous one ended (no overlap, no gap), each is as long as its dtype times its shape, and the
    last ends at the end of the file. Safetensors' own reader refuses anything else, but only when a
    tensor is first read (in the middle of a generation, without the file's name): this says it at load."""
    def bad(key: str, what: str) -> ModelPackageError:
        return ModelPackageError(f"{name} is not a readable safetensors file (tensor {key[:200]!r} {what}); it is "
                                 "damaged or truncated, download it again.")

    spans = []
    for key, info in header.items():
        begin, end = info["data_offsets"]
        if begin < 0 or end < begin:
            raise bad(key, f"has data_offsets [{begin}, {end}], which is not a range")
        if end > data_bytes:
            raise bad(key, f"ends at byte {end:,} of the data, but the file holds {data_bytes:,} bytes of data")
        itemsize = _SAFETENSORS_DTYPES[info["dtype"]].itemsize
        if end - begin != itemsize * math.prod(info["shape"]):
            raise bad(key, f"takes {end - begin:,} bytes, but its {info['dtype']} shape {info['shape']} needs "
                      f"{itemsize * math.prod(info['shape']):,}")
        spans.append((begin, end, key))
    fault = span_fault(spans, gaps=False)
    if fault:
        raise bad(fault[0], fault[1])
    position = max((end for _, end, _ in spans), default=0)
    if position != data_bytes:
        raise ModelPackageError(f"{name} is not a readable safetensors file (the tensors end at byte {position:,} of "
                                f"the data but the file holds {data_bytes:,}); it is damaged or truncated, download "
                                "it again.")


def span_fault(spans, *, gaps: bool):
    """``(name, what)`` of the first tensor, by offset, whose byte range ``(begin, end, name)`` overlaps the one
    before it (or, unless ``gaps``, does not begin where it ended; GGUF pads between tensors); None when the
    ranges are disjoint. Two tensors over the same bytes would make one file look like two models (and a
    write through one view change the other)."""
    position, previous = 0, None
    for begin, end, key in sorted(spans):
        if begin < position or (begin > position and not gaps):
            what = "overlaps the tensor before it" if begin < position else "leaves a gap of unused bytes before it"
            return key, (f"{what}, {previous[:200]!r} (it begins at byte {begin:,} of the data, {previous[:200]!r} "
                         f"ends at {position:,})" if previous is not None else
                         f"{what} (it begins at byte {begin:,} of the data)")
        if end > position or previous is None:
            position, previous = end, key
    return None


def safetensors_header(path) -> Dict[str, dict]:
    """The tensor table of a safetensors file (reads only its JSON header, checked as the reader does)."""
    return _read_header(Path(path))[2]


def check_readable(path: Path, component: str) -> None:
    """Open a safetensors file's header only (no tensor is read); a truncated file fails here."""
    from safetensors import SafetensorError, safe_open

    try:
        _read_header(Path(path))
    except ModelPackageError as e:
        raise ModelPackageError(f"{component}: {e}") from None
    try:
        with safe_open(str(path), framework="pt", device="cpu"):
            pass
    except (SafetensorError, OSError) as e:
        raise ModelPackageError(
            f"{component}: {path.name} is not a readable safetensors file ({e}); it may be truncated, download it again."
        ) from None


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsReader:
    """One safetensors file, tensor by tensor. Tensors kept as they are come memory-mapped (safetensors'
    own reader: no copy, file-backed pages); tensors that are converted right away (bf16 -> fp8) are
    read with plain file reads into one reused buffer, so a conversion holds only its results plus the
    tensor being read. The header (JSON) is validated against the file size; nothing is executed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        _, n, header = _read_header(self.path)
        self._start = 8 + n
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._mapped = None
        self._entries = {}
        for key, info in header.items():  # offsets and sizes: checked by _read_header
            begin, end = info["data_offsets"]
            self._entries[key] = (_SAFETENSORS_DTYPES[info["dtype"]], list(info["shape"]), begin, end)

    def keys(self):
        return list(self._entries)

    def shape(self, key: str):
        return self._entries[key][1]

    def nbytes(self, key: str) -> int:
        return self._entries[key][3] - self._entries[key][2]

    def get(self, key: str, scratch: bool = False) -> torch.Tensor:
        """The tensor ``key``, memory-mapped; with ``scratch``, read into a buffer that the next scratch
        read reuses (for tensors converted right away: one allocation instead of one per tensor, which
        would leave freed blocks in the C heap)."""
        dtype, shape, begin, end = self._entries[key]
        if not scratch:
            from safetensors import safe_open

            if self._mapped is None:
                self._mapped = safe_open(str(self.path), framework="pt", device="cpu")
            return self._mapped.get_tensor(key)
        if self._scratch.numel() < end - begin:
            self._scratch = torch.empty(end - begin, dtype=torch.uint8)
        buf = self._scratch[:end - begin]
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            if f.readinto(memoryview(buf.numpy())) != end - begin:
                raise ModelPackageError(f"{self.path.name}: tensor {key!r} could not be read completely; download the file again.")
        return buf.view(dtype).reshape(shape)


def checkpoint_tensor(folder: Path, name: str, key: str, dtype: torch.dtype) -> torch.Tensor:
    """One DiT tensor as :func:`load_transformer` produced it for a non-fp8 ``dtype`` (memory-mapped
    when no conversion is needed): LoRA changes restore merged weights from it."""
    from safetensors import SafetensorError

    try:
        for path in safetensors_files(folder, name, "diffusion_pytorch_model"):
            reader = SafetensorsReader(path)
            if key not in reader.keys():
                continue
            tensor = reader.get(key)
            scale = None
            if scale_name(key) in reader.keys():
                scale = checkpoint_scale(key, reader.get(scale_name(key)), reader.shape(key))
            if scale is not None or is_fp8(tensor.dtype):
                return dequantize(tensor, scale, dtype)
            return tensor.to(dtype)
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelPackageError(f"{name}: could not read {key} again from {folder} ({e}); reload the pipeline.") from None
    raise ModelPackageError(f"{name}: {key} is no longer in {folder}; the package changed since it was loaded, reload the pipeline.")


class GGUFFile:
    """One GGUF file read through gguf-py's memory map: nothing is copied or expanded. Each tensor comes
    back as a torch view of the mapped bytes in checkpoint order (the reverse of ggml's dimension order):
    float types as themselves, block-quantized types as ``uint8`` rows of blocks (last dimension in
    bytes) with their GGML type. The map is copy-on-write (private): the views are writable for torch,
    and nothing ever writes the file."""

    def __init__(self, path: Path, component: str = "transformer"):
        self.path = Path(path)
        self.component = component
        try:
            import gguf
        except ImportError:
            raise ModelPackageError(f"{component}: reading {self.path.name} needs the 'gguf' package "
                                    "(pip install gguf, listed in requirements.txt).") from None
        try:
            self._reader = gguf.GGUFReader(str(self.path), "c")
        except ValueError as e:
            text = str(e)
            if "is not a valid GGMLQuantizationType" in text:
                raise ModelPackageError(f"{component}: {self.path.name} uses a GGML quantization type that gguf-py "
                                        f"does not know ({text}); re-download it or use a Q3_K..Q8_0 file.") from None
            raise ModelPackageError(f"{component}: {self.path.name} is not a readable GGUF file ({text}); "
                                    "it may be truncated, download it again.") from None
        except (OSError, IndexError, KeyError, TypeError) as e:
            raise ModelPackageError(f"{component}: {self.path.name} is not a readable GGUF file ({e}); "
                                    "it may be truncated, download it again.") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        base = int(self._reader.data_offset)
        fault = span_fault([(int(t.data_offset) - base, int(t.data_offset) - base + int(t.n_bytes), t.name)
                            for t in self._reader.tensors], gaps=True)
        if fault:
            raise ModelPackageError(f"{component}: {self.path.name} is not a readable GGUF file (tensor {fault[0][:200]!r} "
                                    f"{fault[1]}); it is damaged or forged, download it again.")

    def keys(self):
        return list(self._tensors)

    def qtype(self, key: str):
        return self._tensors[key].tensor_type

    def shape(self, key: str) -> tuple:
        """The checkpoint (torch) shape of ``key``: ggml's dimensions reversed."""
        return tuple(int(d) for d in reversed(self._tensors[key].shape.tolist()))

    def offset(self, key: str) -> int:
        return int(self._tensors[key].data_offset)

    def nbytes(self, key: str) -> int:
        return int(self._tensors[key].n_bytes)

    def metadata(self, key: str):
        """A key/value field's value (e.g. ``general.architecture``), or None when absent."""
        field = self._reader.get_field(key)
        if field is None:
            return None
        try:
            return field.contents()
        except (ValueError, IndexError, AttributeError):
            return None

    def get(self, key: str) -> torch.Tensor:
        """The mapped tensor (no copy); BF16 ones as ``bfloat16`` (gguf-py hands them out as bytes)."""
        import warnings

        entry = self._tensors[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a private map is writable; numpy may still flag it
            t = torch.from_numpy(entry.data)
        if entry.tensor_type.name == "BF16":
            t = t.view(torch.bfloat16)
        return t

    def mapped(self) -> torch.Tensor:
        """The whole file as one ``uint8`` view (for strided views over tensors that lie at even strides)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._reader.data)

    def file_bytes(self) -> int:
        return self.path.stat().st_size
