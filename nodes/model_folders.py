"""Which model packages the loader offers, and resolving a chosen name back to a folder.

A package is a directory with a ``model_index.json`` under ComfyUI's ``models/diffusers/`` or the
pack's own ``models/lingbot_video/`` (both extendable through ``extra_model_paths.yaml``). Only names
from this listing are ever loaded, so a workflow cannot point the loader at an arbitrary path.
"""

from __future__ import annotations

import os
from typing import Dict, List

import folder_paths

from ..lingbot_core.files.checkpoint_files import is_safetensors
from ..lingbot_core.model.text_encoder_gguf import is_mmproj

FOLDER_KEY = "lingbot_video"
MAX_DEPTH = 3  # how deep below a models folder a package may sit (e.g. "org/name")

folder_paths.add_model_folder_path(FOLDER_KEY, os.path.join(folder_paths.models_dir, FOLDER_KEY))


def _roots() -> List[str]:
    roots = []
    for key in ("diffusers", FOLDER_KEY):
        try:
            roots += folder_paths.get_folder_paths(key)
        except KeyError:
            pass
    return roots


def list_packages() -> Dict[str, str]:
    """``{display name: absolute folder}`` for every package found, first root wins on a name clash.

    Symlinked folders are followed (users link big downloads in), but never into one of their own
    ancestors: a link loop (``loop -> ..``) would otherwise list every package again under
    ``loop/``, ``loop/loop/``, ...
    """
    found: Dict[str, str] = {}

    def visit(sub: str, path: str, is_dir: bool) -> bool:
        if is_dir and os.path.isfile(os.path.join(path, "model_index.json")):
            found.setdefault(sub, path)
            return False  # a package's subfolders are components, not packages
        return is_dir

    for root in _roots():
        if os.path.isdir(root):
            _walk(root, "", (os.path.realpath(root),), visit)
    return dict(sorted(found.items()))


def _walk(folder: str, rel: str, ancestors: tuple, visit) -> None:
    """Call ``visit(name relative to the root, path, is_dir)`` for every entry below ``folder`` in name
    order, hidden names skipped, and descend into a folder when ``visit`` returns True, at most
    :data:`MAX_DEPTH` levels deep. Symlinked folders are followed, but never into one of their own
    ancestors."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        if name.startswith("."):
            continue
        path = os.path.join(folder, name)
        sub = f"{rel}/{name}" if rel else name
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if real not in ancestors and visit(sub, path, True) and sub.count("/") + 1 < MAX_DEPTH:
                _walk(path, sub, ancestors + (real,), visit)
        elif os.path.isfile(path):
            visit(sub, path, False)


def package_choices() -> List[str]:
    """The ``model`` dropdown of every node that picks a package (a placeholder when none is found)."""
    return list(list_packages()) or ["(no LingBot-Video package found)"]


# The files loader's ``model`` choice for a pipeline made of its three files alone (no package folder).
NO_PACKAGE = "(none: the three files)"


def files_package_choices() -> List[str]:
    """The files loader's ``model`` dropdown: the three files alone first, then the packages found."""
    return [NO_PACKAGE, *list_packages()]


def resolve_package(name: str) -> str:
    """The folder of a listed package; anything else (paths, '..', unknown names) is refused."""
    packages = list_packages()
    if name not in packages:
        listed = ", ".join(packages) or "none found"
        raise ValueError(
            f"model {name!r} is not one of the LingBot-Video packages found in models/diffusers or "
            f"models/{FOLDER_KEY} ({listed}). Put the package folder (with model_index.json) there and "
            "refresh the browser; paths typed into the workflow are not accepted."
        )
    return packages[name]


# -- LoRA files: ComfyUI's models/loras (extendable through extra_model_paths.yaml) ------------------

LORA_FOLDER_KEY = "loras"


def list_loras() -> List[str]:
    """The ``.safetensors`` files in ComfyUI's ``loras`` folders, as ComfyUI names them (relative paths)."""
    try:
        names = folder_paths.get_filename_list(LORA_FOLDER_KEY)
    except KeyError:
        return []
    return sorted(n for n in names if is_safetensors(n))


def lora_choices() -> List[str]:
    return list_loras() or ["(no .safetensors LoRA found in models/loras)"]


def resolve_lora(name: str) -> str:
    """The path of a listed LoRA file; anything else (paths, '..', pickles, unknown names) is refused."""
    listed = list_loras()
    path = folder_paths.get_full_path(LORA_FOLDER_KEY, name) if name in listed else None
    if path is None:
        shown = ", ".join(listed[:10]) + (f" and {len(listed) - 10} more" if len(listed) > 10 else "") or "none found"
        raise ValueError(
            f"LoRA {name!r} is not one of the .safetensors files in models/loras ({shown}). Put the file there and "
            "refresh the browser; paths typed into the workflow are not accepted."
        )
    return path


# -- single component files (the files ComfyUI users already have) ------------------------------------

# Component -> (ComfyUI folder keys searched in order, accepted suffixes).
COMPONENT_FOLDERS = {
    "transformer": (("diffusion_models", "unet"), (".gguf", ".safetensors")),
    "text_encoder": (("text_encoders", "clip"), (".safetensors", ".gguf")),  # GGUF: llama.cpp's text model
    "vae": (("vae",), (".safetensors",)),
}
FROM_PACKAGE = "(from the package)"


def list_component_files(component: str) -> Dict[str, str]:
    """``{name relative to its models folder: path}`` of the files a component may be loaded from, first
    folder wins. The folders are scanned here rather than through ``folder_paths.get_filename_list``,
    whose extension lists (ComfyUI's own) do not include ``.gguf``; symlinks are followed, link loops
    are not, and the depth is bounded as for packages."""
    keys, suffixes = COMPONENT_FOLDERS[component]
    found: Dict[str, str] = {}

    def visit(sub: str, path: str, is_dir: bool) -> bool:
        # llama.cpp's mmproj-*.gguf beside a text GGUF is a vision projector, not a text encoder of its own
        skip = component == "text_encoder" and is_mmproj(path)
        if not is_dir and sub.lower().endswith(suffixes) and not skip:
            found.setdefault(sub, path)
        return is_dir

    for key in keys:
        try:
            roots = folder_paths.get_folder_paths(key)
        except KeyError:
            continue
        for root in roots:
            if os.path.isdir(root):
                _walk(root, "", (os.path.realpath(root),), visit)
    return dict(sorted(found.items()))


def component_file_choices(component: str) -> List[str]:
    return [FROM_PACKAGE, *list_component_files(component)]


def resolve_component_file(component: str, name: str):
    """The path of a listed file, or None for :data:`FROM_PACKAGE`; anything else is refused."""
    if name == FROM_PACKAGE:
        return None
    listed = list_component_files(component)
    if name not in listed:
        keys, suffixes = COMPONENT_FOLDERS[component]
        shown = ", ".join(list(listed)[:10]) or "none found"
        raise ValueError(
            f"{component} file {name!r} is not one of the {'/'.join(suffixes)} files in models/{' or models/'.join(keys)} "
            f"({shown}). Put the file there and refresh the browser; paths typed into the workflow are not accepted."
        )
    return listed[name]
