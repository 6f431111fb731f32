"""attn_implementation="tiled" for Hugging Face transformers: the engine in transformers' own attention registry.

    import attention_core.integrations.transformers          # registers "tiled" (or call register() again)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="tiled")
    model.set_attn_implementation("tiled")                   # or switch a loaded model; from_config takes it too

register() adds NAME to transformers' AttentionInterface (the attention function, attention_forward) and to its
AttentionMaskInterface (the mask that function wants, attention_mask): only the models configured with "tiled" use
it; every other model and library in the process keeps its own attention, and torch's SDPA is never patched.
Importing this module registers; `import attention_core` never does. Needs transformers >= 4.56 (the release whose
mask interface this uses; 4.57 and 5.x are tested); an older one raises ImportError saying so.

What it covers (what transformers' "sdpa" covers), every call in the engine, never a silent fallback:
  - causal and padding masks: transformers' own sdpa mask (None -> is_causal; a boolean mask otherwise), so the
    dynamic and static KV caches and left padding in generate() mask exactly as "sdpa" does
  - grouped-query attention without repeating key/value heads (the engine's enable_gqa)
  - sliding-window layers (Mistral, Qwen2, Gemma 3's mixed local/global layers): transformers' sliding-window masks
  - dropout in training (the module's attention_dropout, the engine's dropout)
  - packed sequences (several documents per row told apart by position_ids, as DataCollatorWithFlattening makes
    them, or its cu_seq_lens_q, which is read, as "flash_attention_2" reads it, also without position_ids): no N x N
    mask is built; the mask function returns PACKED (a (batch, 0) boolean tensor) and each document runs causally on
    its own, in O(N) memory, as "flash_attention_2" does. A document longer than a sliding window gets that window's
    band mask (document x document booleans) for that document. transformers 4.5x on torch < 2.6 never marks packed
    rows (its "sdpa" attends across the documents): there they are found from position_ids here, per document where
    transformers gave no mask, else by a block-diagonal mask added to the one it gave.
What it refuses, with the implementation that has it: attention-logit soft-capping (Gemma 2: "eager"),
output_attentions=True ("eager"), attention sinks (s_aux: "eager"), position_bias ("sdpa").
Counts: each call runs under count_as=COUNT_KEY (attention_core.kernel.counts: calls(COUNT_KEY) -> (all, compiled)).
The calls go to the engine directly, not through torch.nn.functional.scaled_dot_product_attention, so the
process-wide patch (attention_core.patch) never sees them: used together, no call is routed twice.
torch.compile: works, fullgraph=True too (the engine is a custom op). Inside a compiled graph the document bounds
cannot be read on the host, so there a packed row (and transformers asks for one whenever the model runs without a
cache, position_ids given or not) runs as one engine call with a block-diagonal causal mask (N x N booleans, as
"sdpa" does); eager calls keep the O(N) per-document path.
"""
from __future__ import annotations

import weakref

import torch

from ..kernel import counts
from ..sdpa import scaled_dot_product_attention

NAME = "tiled"
COUNT_KEY = "transformers:" + NAME
MIN_TRANSFORMERS = (4, 56)

_packing_marked = True  # register() reads it from transformers (see _marks_packing)

__all__ = ["register", "attention_forward", "attention_mask", "NAME", "COUNT_KEY", "is_packed_marker"]


def _transformers():
    """transformers' AttentionInterface and AttentionMaskInterface classes; ImportError naming what is needed."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("attention_core.integrations.transformers: transformers is not installed "
                          "(pip install 'transformers>=4.56')") from e
    installed = _version(transformers)
    version = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        AttentionInterface = AttentionMaskInterface = None
    if version < MIN_TRANSFORMERS or AttentionInterface is None or AttentionMaskInterface is None:
        raise ImportError(f"attention_core.integrations.transformers: transformers {installed} has no "
                          f"attention registry with masks this integration can use; attn_implementation='tiled' needs "
                          f"transformers >= {MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]} (or use the process-wide "
                          f"patch, attention_core.enable(), with attn_implementation='sdpa')")
    return AttentionInterface, AttentionMaskInterface


def _version(transformers) -> str:
    return transformers.__version__


def register(name: str = NAME) -> str:
    """Register the engine under `name` in transformers' AttentionInterface and AttentionMaskInterface (again:
    harmless). Returns the name to pass as attn_implementation."""
    global _packing_marked
    attention_interface, mask_interface = _transformers()
    from transformers import masking_utils
    _packing_marked = bool(getattr(masking_utils, "_is_torch_greater_or_equal_than_2_6", True))
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, attention_mask)
    return name


# ---- the mask --------------------------------------------------------------------------------------------------

def is_packed_marker(mask) -> bool:
    """True for the mask attention_mask() returns for packed sequences: a (batch, 0) boolean tensor."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == 0


def _sdpa_mask():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]


def attention_mask(batch_size, *args, **kwargs):
    """The mask function transformers calls for NAME (AttentionMaskInterface): transformers' own sdpa mask (None
    where is_causal does it, else a (batch, 1, q, kv) boolean mask), except for packed sequences.

    transformers asks for a packed mask (position_ids restarting inside a row) only without a padding mask and
    without a cache, and it then forbids the is_causal shortcut while building a plain (non-vmap) mask function; in
    exactly that case this returns PACKED, a (batch, 0) boolean tensor, and attention_forward finds the documents
    from the position_ids it is passed (a call of that shape that is not packed comes out plain causal, as its mask
    would be)."""
    mask = kwargs.get("attention_mask")
    q_length = kwargs.get("q_length")
    if q_length is None:  # transformers 4.5x: cache_position instead of q_length / q_offset
        cache_position = kwargs.get("cache_position", args[0] if args else None)
        q_length = cache_position.shape[0] if cache_position is not None else None
    if (mask is None and kwargs.get("allow_is_causal_skip", True) is False and not kwargs.get("use_vmap", False)
            and not kwargs.get("or_mask_function") and not kwargs.get("and_mask_function")
            and isinstance(kwargs.get("kv_offset", 0), int) and kwargs.get("kv_offset", 0) == 0
            and isinstance(kwargs.get("q_offset", 0), int) and kwargs.get("q_offset", 0) == 0
            and q_length is not None and kwargs.get("kv_length") == q_length):
        return torch.zeros(batch_size, 0, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    return _sdpa_mask()(batch_size, *args, **kwargs)


# ---- packed documents ------------------------------------------------------------------------------------------

# (weakref to the position_ids tensor, (its _version, batch), bounds) of the latest packed call: every layer of a forward gets
# the same tensor, so the host reads it once per forward; replaced whole, never mutated (threads read it whole)
_last_bounds = (None, None, None)


def _document_bounds(position_ids, cu_seqlens, batch: int, length: int) -> list:
    """[[(start, end), ...] per row]: the documents of each row, from cu_seq_lens_q (flattened rows, batch 1) or
    from position_ids (a new document wherever the position does not go up by one)."""
    if cu_seqlens is not None:
        cuts = [int(c) for c in cu_seqlens.tolist()]
        if batch != 1 or cuts[-1] != length:
            raise ValueError(f"attn_implementation='{NAME}': cu_seq_lens_q {cuts} does not describe one flattened row "
                             f"of {length} tokens (batch {batch})")
        return [list(zip(cuts[:-1], cuts[1:]))]
    if position_ids is None:
        return [[(0, length)]] * batch
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    global _last_bounds
    try:
        current = position_ids._version
    except RuntimeError:  # an inference-mode tensor has no version counter: nothing cached
        current = None
    ref, version, bounds = _last_bounds
    if current is not None and ref is not None and ref() is position_ids and version == (current, batch):
        return bounds
    pos = position_ids.expand(batch, -1)
    starts = torch.diff(pos, dim=-1) != 1  # a start at column c + 1
    rows = []
    cuts_all = torch.nonzero(starts).tolist()  # one host read for every row
    per_row = [[] for _ in range(batch)]
    for b, c in cuts_all:
        per_row[b].append(c + 1)
    for cuts in per_row:
        edges = [0] + cuts + [length]
        rows.append(list(zip(edges[:-1], edges[1:])))
    if current is not None:
        _last_bounds = (weakref.ref(position_ids), (current, batch), rows)
    return rows


def _band(length: int, window: int, device) -> torch.Tensor:
    """Causal sliding-window mask as transformers defines it: key j visible to query i iff i - window < j <= i."""
    i = torch.arange(length, device=device).view(-1, 1)
    j = torch.arange(length, device=device).view(1, -1)
    return (j <= i) & (j > i - window)


def _causal_call(q, k, v, window, dropout, scaling, gqa):
    """One causal document (q, k, v of the same length), inside a sliding window where one is given."""
    length = q.shape[-2]
    if window is not None and length > window:
        return scaled_dot_product_attention(q, k, v, attn_mask=_band(length, window, q.device), dropout_p=dropout,
                                            scale=scaling, enable_gqa=gqa, count_as=counts.traced_key(COUNT_KEY))
    return scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=length > 1, scale=scaling,
                                        enable_gqa=gqa, count_as=counts.traced_key(COUNT_KEY))


def _block_diagonal(position_ids, cu_seqlens, batch: int, length: int, window, device) -> torch.Tensor:
    """(batch, 1, length, length) booleans: causal inside each document (and its sliding window), nothing across."""
    i = torch.arange(length, device=device)
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens[1:].to(device), i, right=True).view(1, -1).expand(batch, -1)
    else:
        pos = position_ids.view(-1, length).expand(batch, -1)
        doc = torch.cat([torch.zeros_like(pos[:, :1]), (torch.diff(pos, dim=-1) != 1).long()], dim=-1).cumsum(-1)
    mask = (doc[:, :, None] == doc[:, None, :]) & (i.view(-1, 1) >= i.view(1, -1))
    if window is not None:
        mask = mask & (i.view(1, -1) > i.view(-1, 1) - window)
    return mask.unsqueeze(1)


def _packed(q, k, v, kwargs, window, dropout, scaling, gqa):
    batch, length = q.shape[0], q.shape[-2]
    if k.shape[-2] != length:
        raise ValueError(f"attn_implementation='{NAME}': packed sequences need as many keys as queries (no cache), got "
                         f"{length} queries and {k.shape[-2]} keys")
    if torch.compiler.is_dynamo_compiling():  # no host read inside a graph: one block-diagonal mask, N x N booleans
        position_ids, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
        if position_ids is None and cu is None:
            return _causal_call(q, k, v, window, dropout, scaling, gqa)
        mask = _block_diagonal(position_ids, cu, batch, length, window, q.device)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                            enable_gqa=gqa, count_as=counts.traced_key(COUNT_KEY))
    bounds = _document_bounds(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), batch, length)
    if all(len(row) == 1 for row in bounds):
        return _causal_call(q, k, v, window, dropout, scaling, gqa)
    rows = []
    for b, row in enumerate(bounds):
        qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
        rows.append(torch.cat([_causal_call(qb[:, :, s:e], kb[:, :, s:e], vb[:, :, s:e], window, dropout, scaling,
                                            gqa) for s, e in row], dim=2))
    return torch.cat(rows, dim=0)


# ---- the attention function ------------------------------------------------------------------------------------

def _marks_packing() -> bool:
    """Whether this transformers marks packed rows in its masks (5.x always; 4.5x only on torch >= 2.6): read by
    register(), so that a torch.compile trace reads a plain module value (torch 2.5's dynamo cannot import there)."""
    return _packing_marked


def _refuse(what: str, use: str):
    raise ValueError(f"attn_implementation='{NAME}' (the tiled attention engine) does not support {what}; load this "
                     f"model with attn_implementation='{use}' instead")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function contract (as its sdpa_attention_forward): query (batch, heads, q, dim), key
    and value (batch, kv_heads, kv, dim), the mask attention_mask() made -> (output (batch, q, heads, dim), None)."""
    if kwargs.get("softcap") is not None:
        _refuse(f"attention-logit soft-capping (softcap={kwargs['softcap']}, e.g. Gemma 2's attn_logit_softcapping)",
                "eager")
    if kwargs.get("output_attentions"):
        _refuse("output_attentions=True (it never forms the attention weights)", "eager")
    if kwargs.get("s_aux") is not None:
        _refuse("attention sinks (s_aux)", "eager")
    if kwargs.get("position_bias") is not None:
        _refuse("an additive position_bias", "sdpa")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not is_packed_marker(attention_mask):
        raise ValueError(f"attn_implementation='{NAME}': got a 2-D attention mask {tuple(attention_mask.shape)}; this "
                         "model was not given the masks of attention_core.integrations.transformers.attention_mask "
                         "(register() registers both)")
    gqa = bool(getattr(module, "num_key_value_groups", 1) > 1) or query.shape[1] != key.shape[1]
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    packed = is_packed_marker(attention_mask) or (  # cu_seq_lens_q alone (no restarting position_ids) packs too,
        attention_mask is None and kwargs.get("cu_seq_lens_q") is not None  # as "flash_attention_2" reads it
        and q_length == key.shape[2] and q_length > 1)
    if (not packed and bool(is_causal) and q_length > 1 and key.shape[2] == q_length and not _marks_packing()
            and (kwargs.get("position_ids") is not None or kwargs.get("cu_seq_lens_q") is not None)):
        # a transformers that never marks packed rows (4.5x on torch < 2.6; its "sdpa" attends across documents):
        # the documents are found here, per document in eager calls without a mask, else by a block-diagonal mask
        if attention_mask is None and not torch.compiler.is_dynamo_compiling():
            packed = True
        else:
            docs = _block_diagonal(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), query.shape[0], q_length,
                                   None, query.device)
            if attention_mask is None:
                attention_mask = docs
            elif attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & docs
            else:
                attention_mask = attention_mask.masked_fill(~docs, float("-inf"))
    if packed:
        out = _packed(query, key, value, kwargs, window if is_causal else None, dropout, scaling, gqa)
    else:
        is_causal = q_length > 1 and attention_mask is None and bool(is_causal)
        if is_causal and key.shape[2] > q_length:  # an empty static cache's prefill: the keys past it are unused
            key, value = key[:, :, :q_length], value[:, :, :q_length]
        out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                           is_causal=is_causal, scale=scaling, enable_gqa=gqa,
                                           count_as=counts.traced_key(COUNT_KEY))
    return out.transpose(1, 2).contiguous(), None


register()
