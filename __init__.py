"""ComfyUI entry point of the Tiled Attention pack (V3: `comfy_entrypoint`). Importing it logs one line saying
whether this GPU needs tiled attention and patches nothing; ComfyUI's loader then calls `comfy_entrypoint`, which
registers the "tiled" attention backend name (no default changes) and lists the nodes. Patching happens per
workflow, in the nodes, on clones."""
import logging

from .nodes import comfy_entrypoint

__all__ = ["comfy_entrypoint"]


def _log_verdict():
    try:
        import torch

        from .attention_core import detect
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        logging.getLogger("tiled_attention").info("[tiled-attention] %s", detect(device).summary())
    except Exception as e:  # noqa: BLE001 - a report must never break ComfyUI's start
        logging.getLogger("tiled_attention").warning("[tiled-attention] device detection failed: %s", e)


_log_verdict()
