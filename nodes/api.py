"""The one pinned ComfyUI node API version the pack's nodes are written against: comfy_api v0_0_2, present in
every ComfyUI the pack supports (0.3.60 on; tested on 0.3.75 and 0.33.0), never `latest`."""
from comfy_api.v0_0_2 import ComfyExtension, io  # noqa: F401

__all__ = ["ComfyExtension", "io"]
