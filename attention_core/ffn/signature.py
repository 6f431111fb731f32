"""Which calls FFN chunking can represent, and what makes two calls the same signature (one verdict each).

A call is chunked along `dim` only when its first argument is a floating tensor of two or more axes whose token
axis is not the last (feature) axis, and no other tensor argument has a per-token axis (its pieces would not line
up). The signature of a call: shapes, dtypes and devices of every tensor in it, the other values as they are,
and the owner module's train/eval mode.
"""
import torch


def token_dim(x, dim):
    """The token axis, or None when this call cannot be chunked (then the plain call runs)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(dim, int):
        return None
    if not -x.dim() <= dim < x.dim():
        return None
    dim = dim % x.dim()
    if dim == x.dim() - 1:  # the feature axis (e.g. a 2-D (tokens, features) input with dim=1)
        return None
    return dim


def has_per_token_argument(args, kwargs, dim: int, n: int) -> bool:
    """True when a tensor among the extra arguments has n entries along the token axis."""
    return any(t.dim() > dim and t.shape[dim] == n for t in tensors_in((args, kwargs)))


def call_key(x, args, kwargs, training):
    """The verdict cache key of a call."""
    return (signature_of(x), signature_of(args), signature_of(kwargs), training)


def signature_of(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(signature_of(e) for e in v)
    if isinstance(v, dict):
        return ("dict",) + tuple((k, signature_of(e)) for k, e in sorted(v.items(), key=lambda kv: str(kv[0])))
    try:
        hash(v)
        return v
    except TypeError:
        return ("id", id(v))


def tensors_in(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for e in v:
            yield from tensors_in(e)
    elif isinstance(v, dict):
        for e in v.values():
            yield from tensors_in(e)
