"""flash_attn_func's calling convention on the engine, for frameworks that take such a callable (yunchang's
UlyssesAttention, xDiT through yunchang): [B, L, H, D] tensors, GQA by head count."""
from __future__ import annotations

from ..sdpa import scaled_dot_product_attention


def flash_layout_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args,
                           **kwargs):
    """flash_attn_func's calling convention ([B, L, H, D] tensors, GQA by head count) on this engine; returns out
    [B, L, H, Dv]. Options the engine does not have (sliding window, softcap, ALiBi, attention probabilities)
    raise NotImplementedError rather than being ignored."""
    if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError(
            f"flash_layout_attention: window_size={window_size}, softcap={softcap}, alibi_slopes="
            f"{'set' if alibi_slopes is not None else None}, return_attn_probs={return_attn_probs} are not "
            f"supported by the tiled engine; only dropout_p, softmax_scale and causal are")
    out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout_p,
                                       causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
