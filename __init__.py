"""ComfyUI entry point of the Tiled Attention pack. Importing it registers nodes and logs one line saying
whether this GPU needs tiled attention; it patches nothing (patching happens per workflow, in the nodes)."""
import logging

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]


def _log_verdict():
    try:
        import torch

        from .attention_core import detect
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        logging.getLogger("tiled_attention").info("[tiled-attention] %s", detect(device).summary())
    except Exception as e:  # noqa: BLE001 - a report must never break ComfyUI's start
        logging.getLogger("tiled_attention").warning("[tiled-attention] device detection failed: %s", e)


_log_verdict()
