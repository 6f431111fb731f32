"""ComfyUI entry point of the Tiled Attention pack (V3: `comfy_entrypoint`). Importing it patches nothing; ComfyUI's
loader then calls `comfy_entrypoint`, which registers the "tiled" attention backend name (no default changes),
applies the process-wide mode only when the environment variable TILED_ATTENTION_EVERYWHERE asks for it, logs one
line (whether this GPU needs tiled attention, and the process-wide mode) and lists the nodes. Otherwise patching
happens per workflow, in the nodes, on clones. Under a torch older than the engine needs (2.5) it logs that in one
line and lists no nodes, so ComfyUI keeps loading the other packs."""
import logging

# the frontend's node help pages (web/docs/<node id>.md, web/docs/<node id>/<locale>.md), served by ComfyUI under
# /extensions/<this folder's name>/, and one frontend extension (web/js/keep_translations.js: restores this pack's
# node translations where frontend 1.32.9 drops them); translations of the nodes live in locales/
WEB_DIRECTORY = "./web"

try:
    from . import attention_core  # noqa: F401 - first: under too old a torch this raises TorchTooOld
    from .nodes import comfy_entrypoint
except ImportError as e:
    if type(e).__name__ != "TorchTooOld":  # attention_core.device.torch_version: torch older than needed
        raise
    # one log line, and an empty node list so that ComfyUI loads the folder quietly and keeps running
    logging.getLogger("tiled_attention").error("[tiled-attention] not loaded: %s", e)
    NODE_CLASS_MAPPINGS = {}
    __all__ = ["NODE_CLASS_MAPPINGS", "WEB_DIRECTORY"]
else:
    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
