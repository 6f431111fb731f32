"""One attention call, normalised to the canonical layout every tier works on.

torch's SDPA takes q (*batch, Hq, Lq, E), k (*batch, Hk, Lk, E), v (*batch, Hk, Lk, Ev) with broadcasting
over the leading dims, GQA over heads, and a mask broadcastable to (*batch, Hq, Lq, Lk). The tiers see:

    q5    (B, Hkv, G, Lq, E)    G = query heads per key/value head (1 without GQA)
    k4    (B, Hkv, Lk, E)
    v4    (B, Hkv, Lk, Ev)
    mask5 (Bm, Hm, Gm, Mq, Mk)  each dim either full or 1, so it broadcasts against a score tile

Causal masks: is_causal=True and torch's CausalBias upper-left mean key j is visible to query i iff j <= i;
CausalBias lower-right iff j <= i + (Lk - Lq) (causal_offset), without a mask tensor in either case.

GQA is never materialised: the G query heads of one kv head are stacked along the rows of one GEMM
((G*bq) x E @ E x Lk). Every reshape here is a view unless the caller broadcast a batch or head dim, or gave key
and value head counts of their own (torch repeats each by its own factor; both are repeated to their lcm here).

normalize() first checks the arguments as torch's SDPA does (check_arguments: the types its argument parser takes,
validate_sdpa_input's dtype / device / rank rules, its math backend's dropout and GQA rules), raising torch's
exception types.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Optional

import torch


@dataclass
class AttentionProblem:
    q5: torch.Tensor
    k4: torch.Tensor
    v4: torch.Tensor
    mask5: Optional[torch.Tensor]
    causal: bool
    scale: float
    dropout_p: float
    dropout_seed: int
    out_shape: tuple  # shape of the result in the caller's layout (before squeezing a 2-D call)
    squeeze_2d: bool
    causal_offset: int = 0  # causal: key j is visible to query i iff j <= i + causal_offset
    head_offset: int = 0  # for a head group of a larger problem: its first kv head there ...
    heads_total: int = 0  # ... and how many kv heads that problem has (0: this problem is whole)

    @property
    def B(self) -> int:
        return self.q5.shape[0]

    @property
    def Hkv(self) -> int:
        return self.q5.shape[1]

    @property
    def G(self) -> int:
        return self.q5.shape[2]

    @property
    def Lq(self) -> int:
        return self.q5.shape[3]

    @property
    def Lk(self) -> int:
        return self.k4.shape[2]

    @property
    def E(self) -> int:
        return self.q5.shape[4]

    @property
    def Ev(self) -> int:
        return self.v4.shape[3]

    @property
    def device(self) -> torch.device:
        return self.q5.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q5.dtype

    def describe(self) -> str:
        return (f"q {tuple(self.q5.shape[:1])}x{self.Hkv * self.G} heads x {self.Lq} x {self.E}, "
                f"k/v {self.Hkv} heads x {self.Lk} x {self.E}/{self.Ev}, {str(self.dtype).replace('torch.', '')} "
                f"on {self.device}")

    def head_index(self) -> torch.Tensor:
        """Flat (batch, query head) index of every score row in the whole problem, (B, Hkv, G, 1, 1) int64."""
        total = self.heads_total or self.Hkv
        b = torch.arange(self.B, device=self.device, dtype=torch.int64).view(-1, 1, 1)
        h = torch.arange(self.head_offset, self.head_offset + self.Hkv, device=self.device,
                         dtype=torch.int64).view(1, -1, 1)
        g = torch.arange(self.G, device=self.device, dtype=torch.int64).view(1, 1, -1)
        return ((b * total + h) * self.G + g).view(self.B, self.Hkv, self.G, 1, 1)

    def head_group(self, h0: int, h1: int) -> "AttentionProblem":
        """The sub-problem of kv heads [h0, h1) (views; the mask sliced where it has heads)."""
        if h0 == 0 and h1 == self.Hkv:
            return self
        m = self.mask5
        if m is not None and m.shape[1] != 1:
            m = m[:, h0:h1]
        return replace(self, q5=self.q5[:, h0:h1], k4=self.k4[:, h0:h1], v4=self.v4[:, h0:h1], mask5=m,
                       head_offset=self.head_offset + h0, heads_total=self.heads_total or self.Hkv)

    def key_end(self, i1: int) -> int:
        """Keys a query tile ending (exclusive) at row i1 can see: all, or up to i1 + causal_offset with causal
        (at least one, masked, so a tile is never empty)."""
        return max(1, min(self.Lk, i1 + self.causal_offset)) if self.causal else self.Lk

    def mask_tile(self, i0: int, i1: int, j0: int, j1: int) -> Optional[torch.Tensor]:
        m = self.mask5
        if m is None:
            return None
        rows = slice(i0, i1) if m.shape[3] != 1 else slice(None)
        cols = slice(j0, j1) if m.shape[4] != 1 else slice(None)
        return m[:, :, :, rows, cols]


def _sdpa_error(msg: str) -> RuntimeError:
    return RuntimeError(f"scaled_dot_product_attention: {msg}")


def _broadcast(a: int, b: int, what: str) -> int:
    if a == b or b == 1:
        return a
    if a == 1:
        return b
    raise _sdpa_error(f"{what} sizes {a} and {b} do not broadcast")


def causal_bias(attn_mask, is_causal: bool, Lq: int, Lk: int, device=None):
    """torch.nn.attention.bias.CausalBias as torch's SDPA treats it -> (attn_mask, is_causal, causal_offset)."""
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # older torch: no CausalBias
        return attn_mask, is_causal, 0
    if not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal, 0
    if is_causal:
        raise ValueError("CausalBias should not be used with causal=True")
    if attn_mask.seq_len_q == attn_mask.seq_len_kv or attn_mask.variant == CausalVariant.UPPER_LEFT:
        return None, True, 0
    if attn_mask.variant == CausalVariant.LOWER_RIGHT:
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) == (Lq, Lk):
            return None, True, Lk - Lq
        return attn_mask._materialize(device).as_subclass(torch.Tensor), False, 0  # torch's own broadcast errors
    raise ValueError(f"CausalBias.variant must be a CausalVariant type, but found: {attn_mask.variant}")


def _type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ in ("builtins", "torch") else f"{t.__module__}.{t.__name__}"


def _binding_error(name: str, want: str, x) -> TypeError:
    """torch's argument parser's TypeError for an argument of the wrong type."""
    return TypeError(f"scaled_dot_product_attention(): argument '{name}' must be {want}, not {_type_name(x)}")


def _check_bool(name: str, x) -> None:
    """torch's parser takes a Python bool only (not an int, a tensor or a numpy bool) for is_causal / enable_gqa."""
    if not isinstance(x, (bool, torch.SymBool)):
        raise _binding_error(name, "bool", x)


def _is_numpy_number(x) -> bool:
    """torch's is_numpy_scalar: a numpy integer, bool, floating or complex scalar (not a 0-d array); numpy is only
    looked at when the caller has imported it."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.integer, np.bool_, np.floating, np.complexfloating))


def _as_float(name: str, x, optional: bool = False):
    """torch's parser for a float argument (THPUtils_checkDouble, then a 0-d tensor without grad): a Python float
    or int (bool included, subclasses too), a numpy number scalar (bool and complex included: converted as Python's
    float() does, a complex one by its real part with numpy's ComplexWarning), a 0-d tensor without grad (converted
    as item() to double: a complex one with a nonzero imaginary part raises RuntimeError), a SymFloat / SymInt;
    None only where the argument is optional (scale). Anything else (fractions.Fraction, decimal.Decimal, complex,
    str, a 0-d numpy array, an object with __float__) is torch's TypeError. Returns a Python float (None stays
    None)."""
    if x is None and optional:
        return None
    if isinstance(x, (torch.SymFloat, torch.SymInt)):
        return x
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 and not x.requires_grad:
            if x.is_complex():
                z = complex(x)
                if z.imag != 0:
                    raise RuntimeError("value cannot be converted to type double without overflow")
                return z.real
            return float(x)
        raise _binding_error(name, "float", x)
    if isinstance(x, (float, int)) or _is_numpy_number(x):
        return float(x)
    raise _binding_error(name, "float", x)


def check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """What torch checks before its math backend looks at shapes, with torch's exception type: TypeError where
    torch's argument parser refuses a type (_as_float, _check_bool), RuntimeError for validate_sdpa_input's checks (q, k, v of one dtype and one device, at least 2-D; a mask bool, float32 or of
    query's dtype), the math backend's (mask on query's device, GQA head counts, key/value lengths),
    NotImplementedError for complex inputs (torch's softmax has no complex kernel). Returns (dropout_p, scale) as
    Python floats, as given."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise _binding_error(name, "Tensor", t)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise _binding_error("attn_mask", "Tensor", attn_mask)
    dropout_p = _as_float("dropout_p", dropout_p)
    _check_bool("is_causal", is_causal)
    scale = _as_float("scale", scale, optional=True)
    _check_bool("enable_gqa", enable_gqa)
    if not (query.dtype == key.dtype == value.dtype):
        raise _sdpa_error(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                          f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if not (query.device == key.device == value.device):
        raise _sdpa_error(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                          f"{value.device}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise _sdpa_error(f"{name} must have at least 2 dims (L, E), got shape {tuple(t.shape)}")
    if attn_mask is not None and not _is_causal_bias(attn_mask):
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise _sdpa_error(f"Expected attn_mask dtype to be bool or float, got {attn_mask.dtype}")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise _sdpa_error(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                              f"attn_mask.dtype: {attn_mask.dtype} and query.dtype: {query.dtype}: pass "
                              f"attn_mask.to({query.dtype}) (float32 and bool masks go with any query)")
        if attn_mask.device != query.device and not (attn_mask.dim() == 0 and attn_mask.device.type == "cpu"):
            raise _sdpa_error(f"attn_mask is on {attn_mask.device} but query on {query.device}: move the mask to "
                              f"{query.device}.")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.is_nested:
            raise _sdpa_error("nested tensors are not supported by the tiled engine")
    if query.is_complex():
        raise NotImplementedError(f"scaled_dot_product_attention: complex inputs ({query.dtype}) are not "
                                  f"supported, as in torch (its softmax has no complex kernel)")
    if not query.is_floating_point():
        raise _sdpa_error(f"query must be floating point, got {query.dtype}")
    return dropout_p, scale


def check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Refuse what torch's SDPA (its math backend: what torch runs on the GPUs this engine is for) refuses, with
    torch's exception type (see check_inputs; then the math backend's head dim and key/value length rules).
    Returns (dropout_p, scale) as Python floats: dropout_p > 1 raises as torch's dropout does; dropout_p <= 0 or
    NaN means no dropout, as in torch's math backend (`if (dropout_p > 0.0)`); scale may be negative, 0, inf or
    NaN, as in torch."""
    dropout_p, scale = check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if enable_gqa and min(query.dim(), key.dim(), value.dim()) < 3:  # torch reads the head dim (-3) of each
        raise IndexError(f"scaled_dot_product_attention: enable_gqa=True needs query, key and value with a head dim "
                         f"(at least 3-D: [..., H, L, E]), got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise _sdpa_error(f"query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise _sdpa_error(f"key and value sequence lengths differ: {key.shape[-2]} vs {value.shape[-2]}")
    if dropout_p > 1.0:  # torch's dropout: "dropout probability has to be between 0 and 1"
        raise _sdpa_error(f"dropout_p must be in [0, 1], got {dropout_p}")
    if not dropout_p > 0.0:  # negative or NaN: no dropout (torch's math backend)
        dropout_p = 0.0
    return dropout_p, scale


_empty_value_zeros = None  # whether this torch returns zeros for an empty value: read on first need, then kept


def torch_zeros_for_empty_value() -> bool:
    """Whether the torch installed returns zeros where value holds no elements (torch 2.14 does, before any shape
    check; torch 2.5 computes as usual: a broadcast error for zero key/value heads against the query's). Read once,
    in eager code, from torch's own function on tiny CPU tensors (no GQA: nothing divides by zero); inside a
    torch.compile trace before that first read: False (the engine then computes as torch 2.5 does)."""
    global _empty_value_zeros
    if _empty_value_zeros is None:
        if torch.compiler.is_dynamo_compiling():
            return False
        try:
            out = torch._C._nn.scaled_dot_product_attention(torch.zeros(1, 2, 1, 1), torch.zeros(1, 0, 1, 1),
                                                             torch.zeros(1, 0, 1, 1))
            _empty_value_zeros = tuple(out.shape) == (1, 2, 1, 1)
        except RuntimeError:
            _empty_value_zeros = False
    return _empty_value_zeros


def empty_result(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's result where `value` holds no elements (no key/value heads, batch, keys or value dims) and the torch
    installed has that rule (torch_zeros_for_empty_value), else None. torch's math backend checks the types, dtypes, devices, ranks and is_causal with a mask (check_inputs) and
    then returns zeros of the query's shape with value's last dim, whatever the other shapes (head counts, GQA,
    key length, mask shape) and dropout_p are: so does this. The zeros stay connected to the inputs that need
    grad (a zero gradient), as torch's are."""
    check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    attn_mask, is_causal, _ = causal_bias(attn_mask, is_causal, query.shape[-2], key.shape[-2], query.device)
    if is_causal and attn_mask is not None:
        raise _sdpa_error("Explicit attn_mask should not be set when is_causal=True")
    if value.numel() != 0 or not torch_zeros_for_empty_value():
        return None
    out = query.new_zeros((*query.shape[:-1], value.shape[-1]))
    for t in (query, key, value):
        if t.requires_grad and torch.is_grad_enabled():
            out = out + t.reshape(-1)[:0].sum()  # 0, with a (zero) gradient path to t
    return out


def _is_causal_bias(attn_mask) -> bool:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch: no CausalBias
        return False
    return isinstance(attn_mask, CausalBias)


def _repeat_heads(t: torch.Tensor, times: int) -> torch.Tensor:
    """t [..., H, L, D] with each head repeated `times` times in place (torch's repeat_interleave on dim -3)."""
    if times == 1:
        return t
    return t.unsqueeze(-3).expand(*t.shape[:-2], times, *t.shape[-2:]).reshape(*t.shape[:-3], -1, *t.shape[-2:])


def normalize(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, draw_seed: bool = True) -> AttentionProblem:
    """Validate arguments with torch's rules (check_arguments) and build the canonical problem (differentiable
    views). draw_seed=False leaves dropout_seed 0 (the caller passes its own seed to the op)."""
    dropout_p, scale = check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    attn_mask, is_causal, causal_offset = causal_bias(attn_mask, is_causal, query.shape[-2], key.shape[-2],
                                                        query.device)
    if is_causal and attn_mask is not None:
        raise _sdpa_error("Explicit attn_mask should not be set when is_causal=True")

    squeeze_2d = query.dim() == 2 and key.dim() == 2 and value.dim() == 2
    q, k, v = (t if t.dim() >= 3 else t.unsqueeze(0) for t in (query, key, value))

    nd = max(q.dim(), k.dim(), v.dim())
    batch = []
    for i in range(nd - 3):
        sizes = [t.shape[i - (nd - t.dim())] if i >= nd - t.dim() else 1 for t in (q, k, v)]
        b = _broadcast(_broadcast(sizes[0], sizes[1], "batch"), sizes[2], "batch")
        batch.append(b)
    batch = tuple(batch)
    B = math.prod(batch) if batch else 1

    Hq, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if Hk == 0 or Hv == 0 or Hq % Hk != 0 or Hq % Hv != 0:
            raise _sdpa_error(f"Number of heads in key and value must divide the number of heads in query "
                              f"(enable_gqa): query {Hq}, key {Hk}, value {Hv}")
        if Hk != Hv:  # torch repeats key and value heads each by its own factor: both to lcm(Hk, Hv) here (a copy)
            lcm = Hk * Hv // math.gcd(Hk, Hv)
            k, v = _repeat_heads(k, lcm // Hk), _repeat_heads(v, lcm // Hv)
            Hk = Hv = lcm
        Hkv, G, Hout = Hk, Hq // Hk, Hq
    else:
        Hkv_full = _broadcast(Hk, Hv, "key/value head")
        Hout = _broadcast(Hq, Hkv_full, "query/key head")
        if Hkv_full == Hout:
            Hkv, G = Hout, 1
        else:  # key and value broadcast over query heads: one kv head, all query heads stacked
            Hkv, G = 1, Hout

    Lq, E = q.shape[-2], q.shape[-1]
    Lk, Ev = k.shape[-2], v.shape[-1]

    def to_b(t, heads):
        t = t.expand(*batch, heads, t.shape[-2], t.shape[-1]) if (t.shape[:-3] != batch or t.shape[-3] != heads) \
            else t
        return t.reshape(B, heads, t.shape[-2], t.shape[-1])

    q5 = to_b(q, Hout).view(B, Hkv, G, Lq, E)
    k4 = to_b(k, Hkv)
    v4 = to_b(v, Hkv)

    mask5 = None
    if attn_mask is not None:
        mask5 = _normalize_mask(attn_mask, query.dtype, batch, B, Hout, Hkv, G, Lq, Lk)

    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    seed = 0
    if dropout_p > 0.0 and draw_seed:
        seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    out_shape = (*batch, Hout, Lq, Ev)
    return AttentionProblem(q5=q5, k4=k4, v4=v4, mask5=mask5, causal=bool(is_causal), scale=float(scale),
                            dropout_p=float(dropout_p), dropout_seed=seed, out_shape=out_shape,
                            squeeze_2d=squeeze_2d, causal_offset=causal_offset)


def _normalize_mask(mask, qdtype, batch, B, Hout, Hkv, G, Lq, Lk):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"scaled_dot_product_attention: attn_mask must be a tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise _sdpa_error(f"Expected attn_mask dtype to be bool or float, got {mask.dtype}")
    full = (*batch, Hout, Lq, Lk)
    if mask.dim() > len(full):
        raise _sdpa_error(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {full}")
    m = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))
    for have, want in zip(m.shape, full):
        if have not in (1, want):
            raise _sdpa_error(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the attention "
                              f"weights' shape {full}")
    mb, mh, mq, mk = m.shape[:-3], m.shape[-3], m.shape[-2], m.shape[-1]
    if all(s == 1 for s in mb):
        m = m.reshape(1, mh, mq, mk)
    else:
        m = m.expand(*batch, mh, mq, mk).reshape(B, mh, mq, mk)
    if mh == 1:
        return m.view(m.shape[0], 1, 1, mq, mk)
    return m.view(m.shape[0], Hkv, G, mq, mk)
