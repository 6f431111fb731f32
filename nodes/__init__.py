"""ComfyUI nodes of the pack (V3 API, comfy_api v0_0_2): Patch Attention for a MODEL, a CLIP and a VAE, FFN
Chunking, Attention Info, Attention Fit; and the extension that lists them and registers the "tiled" attention backend."""
from .api import ComfyExtension, io
from .attention import PatchAttention, PatchAttentionCLIP, PatchAttentionVAE
from .backend_registry import register
from .ffn import FFNChunking
from .fit import AttentionFit
from .info import AttentionInfo

NODES = [PatchAttention, PatchAttentionCLIP, PatchAttentionVAE, FFNChunking, AttentionInfo, AttentionFit]


class TiledAttentionExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> TiledAttentionExtension:
    """Called by ComfyUI's loader (0.3.48 on) once at start: registers the backend name and returns the nodes."""
    register()
    return TiledAttentionExtension()
