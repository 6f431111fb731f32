"""The three forward tiers. Each `forward(src, block_q, block_kv, need_stats) -> TileOutputs`.

    chunked  query tiles, full key rows, torch.softmax out of place   fastest; 2 score tiles live
    inplace  query tiles, full key rows, softmax in place in the tile  half the memory of chunked
    online   query x key tiles, FlashAttention-2 running (m, l, O)    O(block_q * block_kv) memory
"""
from . import chunked, inplace, online

TIERS = {"chunked": chunked.forward, "inplace": inplace.forward, "online": online.forward}
ORDER = ("chunked", "inplace", "online")
