"""The user's server list (lingbot_core.net.server_list) in ComfyUI: its file in the user directory, the
dropdown of the Remote Server and Rewriter Server nodes, and their check at queue time."""

from __future__ import annotations

import os

import folder_paths

from ..lingbot_core.net.server_list import FILE_NAME, LOCAL, ServerListError, select_server, server_names, servers_path


def servers_file():
    """``$LINGBOT_SERVERS``, else ``lingbot_servers.json`` in ComfyUI's user directory."""
    return servers_path(os.path.join(folder_paths.get_user_directory(), FILE_NAME))


def server_input(kind: str, what: str) -> tuple:
    names = server_names(servers_file(), kind)
    tooltip = (f"The {what} from your server list ({FILE_NAME} in ComfyUI's user directory, or the file in "
               f"LINGBOT_SERVERS): its address, and its key if it has one, come from that file, never from the "
               f"workflow. {LOCAL!r}: the base_url above, which must be on this machine, without a key.")
    return (names + [LOCAL], {"default": names[0] if names else LOCAL, "tooltip": tooltip})


def check_server(server, base_url, kind: str):
    """ComfyUI's VALIDATE_INPUTS answer: True, or the reason (the prompt is refused with HTTP 400). ``server``
    None: an API-format workflow from before the server list (the input is optional so that the pack, not
    ComfyUI's "Required input is missing", says which entry to add)."""
    if server is not None and base_url is None and server in ("", LOCAL):
        return True  # base_url comes from a link: checked when the node runs
    try:
        select_server(server, base_url, kind=kind, path=servers_file())
    except (ServerListError, ValueError) as e:
        return str(e)
    return True


def endpoint(server, base_url, kind: str):
    return select_server(server, base_url, kind=kind, path=servers_file())


def list_version(**_):
    """An IS_CHANGED value: the file's identity, so that an edited server list is read again."""
    path = servers_file()
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{path}:{st.st_mtime_ns}:{st.st_size}"
