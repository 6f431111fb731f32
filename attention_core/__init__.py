"""attention_core: exact tiled attention in plain PyTorch matmuls, O(N) memory in forward and backward.

Public API
    scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, tier, ...,
                                 return_lse=False)   torch's SDPA; a torch custom op (torch.compile, torch.func)
    ops.attention_forward / ops.attention_backward   raw (out, lse) forward and the backward given O and lse
    TIERS, TIER_CHOICES                          the tier names ("auto" + TIERS is what `tier` accepts)
    detect(device=None) -> DeviceReport         does this device need tiled attention?
    enable(), disable(), is_enabled(), patched()  optional global patch of torch's SDPA (never at import)
    chunk_ffn(module, chunks=0), ChunkedFFN      exact token-chunked feed-forward
Importing this package changes nothing global; under torch < 2.5 it raises torch_version.TorchTooOld (an
ImportError naming the torch needed).
"""
from .device.torch_version import require_torch

require_torch()  # before anything that needs torch >= 2.5: one clear ImportError, not an AttributeError

from .device.detection import DeviceReport, detect
from .ffn import ChunkedFFN, chunk_ffn, unchunk_ffn
from .kernel.memory import AttentionMemoryError
from .patch import disable, enable, is_enabled, patched
from .sdpa import scaled_dot_product_attention
from .kernel.tiers import ORDER as TIERS, TIER_CHOICES

__all__ = ["scaled_dot_product_attention", "detect", "DeviceReport", "enable", "disable", "is_enabled", "patched",
           "chunk_ffn", "unchunk_ffn", "ChunkedFFN", "AttentionMemoryError", "TIERS", "TIER_CHOICES"]
__version__ = "0.1.0"
