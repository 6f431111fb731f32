"""The forward tiers, by name: the one list of tier names (ORDER) every other module and node uses.

Each `forward(src, block_q, block_kv, need_stats) -> TileOutputs` (chunked also takes `layout`, the score layout
the driver's plan carries: "queries" or "keys"); backward.py is the recompute backward.

    chunked  query tiles, full key rows, torch.softmax out of place   fastest; 2 score tiles live
    inplace  query tiles, full key rows, softmax in place in the tile  half the memory of chunked
    online   query x key tiles, FlashAttention-2 running (m, l, O)    O(block_q * block_kv) memory
"""
from . import chunked, inplace, online

TIERS = {"chunked": chunked.forward, "inplace": inplace.forward, "online": online.forward}
ORDER = ("chunked", "inplace", "online")  # largest memory first: "auto" tries them in this order
TIER_CHOICES = ("auto",) + ORDER  # what the `tier` option accepts
