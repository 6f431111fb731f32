"""Inputs of one attention call in the two layouts the planner knows, and a GPU's tiling rules run on the CPU, for
the memory tests (tests/engine/test_plan_memory.py, test_tier_memory_claims.py).

gpu_rules: kernel.memory's device kind "other" (its tile targets, budget share, online key block) and chunked's
softmax written into its second score buffer, as tiers/chunked._softmax_out does off the CPU. The tensors a call
then holds are the same code's as on a GPU; a GPU allocator's rounding and workspaces are not modelled.
"""
import torch

from attention_core.kernel import memory
from attention_core.kernel.tiers import chunked


def gpu_rules(monkeypatch):
    """kernel.memory's GPU device kind on this CPU: its targets, budget share and chunked's two score buffers."""
    monkeypatch.setattr(memory, "_kind", lambda device: "other")
    monkeypatch.setattr(chunked, "_softmax_out", lambda src, s: src.scratch(1, s.shape, s.dtype))


def inputs(layout, dtype, heads, n, dim, batch=1, scale=1.0):
    """q, k, v of `heads` heads x n tokens x dim, standard normal times `scale`: "heads" contiguous [B, H, N, D]
    (WanVideoWrapper's convention), "comfyui" as ComfyUI's optimized_attention views [B, N, H*D]
    (reshape(b, -1, heads, dim).transpose(1, 2))."""
    g = torch.Generator().manual_seed(0)
    if layout == "heads":
        return [torch.randn(batch, heads, n, dim, generator=g).mul_(scale).to(dtype) for _ in range(3)]
    return [torch.randn(batch, n, heads * dim, generator=g).mul_(scale).to(dtype).reshape(batch, -1, heads, dim)
            .transpose(1, 2) for _ in range(3)]
