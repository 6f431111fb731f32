"""ComfyUI nodes of the pack (V3 API, comfy_api v0_0_2): Patch Attention for a MODEL, a CLIP and a VAE, FFN
Chunking, Attention Info, Attention Fit, Tiled Attention Everywhere; and the extension that lists them, registers the
"tiled" attention backend and applies TILED_ATTENTION_EVERYWHERE (the process-wide mode, off unless set)."""
import logging

from .api import ComfyExtension, io
from .attention import PatchAttention, PatchAttentionCLIP, PatchAttentionVAE
from .backend_registry import register
from .everywhere import apply_environment
from .everywhere_node import TiledAttentionEverywhere
from .ffn import FFNChunking
from .fit import AttentionFit
from .info import AttentionInfo, startup_line

NODES = [PatchAttention, PatchAttentionCLIP, PatchAttentionVAE, FFNChunking, AttentionInfo, AttentionFit,
         TiledAttentionEverywhere]


class TiledAttentionExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> TiledAttentionExtension:
    """Called by ComfyUI's loader (0.3.48 on) once at start: registers the backend name, applies
    TILED_ATTENTION_EVERYWHERE (once per process), logs the start line (this GPU's verdict and the process-wide
    mode) and returns the nodes."""
    register()
    apply_environment()
    logging.getLogger("tiled_attention").info("[tiled-attention] %s", startup_line())
    return TiledAttentionExtension()
