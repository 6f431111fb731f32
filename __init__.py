"""ComfyUI entry point of the Tiled Attention pack (V3: `comfy_entrypoint`). Importing it logs one line saying
whether this GPU needs tiled attention and patches nothing; ComfyUI's loader then calls `comfy_entrypoint`, which
registers the "tiled" attention backend name (no default changes) and lists the nodes. Patching happens per
workflow, in the nodes, on clones. Under a torch older than the engine needs (2.5) it logs that in one line and
lists no nodes, so ComfyUI keeps loading the other packs."""
import logging

try:
    from . import attention_core  # noqa: F401 - first: under too old a torch this raises TorchTooOld
    from .nodes import comfy_entrypoint
except ImportError as e:
    if type(e).__name__ != "TorchTooOld":  # attention_core.torch_version: this torch is older than the engine needs
        raise
    # one log line, and an empty node list so that ComfyUI loads the folder quietly and keeps running
    logging.getLogger("tiled_attention").error("[tiled-attention] not loaded: %s", e)
    NODE_CLASS_MAPPINGS = {}
    __all__ = ["NODE_CLASS_MAPPINGS"]
else:
    __all__ = ["comfy_entrypoint"]


def _log_verdict():
    try:
        import torch

        from .attention_core import detect
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        logging.getLogger("tiled_attention").info("[tiled-attention] %s", detect(device).summary())
    except Exception as e:  # noqa: BLE001 - a report must never break ComfyUI's start
        logging.getLogger("tiled_attention").warning("[tiled-attention] device detection failed: %s", e)


if "comfy_entrypoint" in __all__:
    _log_verdict()
