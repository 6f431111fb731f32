"""ComfyUI nodes of the pack: Patch Attention, FFN Chunking, Attention Info."""
from .attention import PatchAttention
from .ffn import FFNChunking
from .info import AttentionInfo

NODE_CLASS_MAPPINGS = {
    "TiledAttentionPatch": PatchAttention,
    "TiledFFNChunking": FFNChunking,
    "TiledAttentionInfo": AttentionInfo,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "TiledAttentionPatch": "Patch Attention (tiled)",
    "TiledFFNChunking": "FFN Chunking",
    "TiledAttentionInfo": "Attention Info",
}
