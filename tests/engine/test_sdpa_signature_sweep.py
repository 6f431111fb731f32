"""The whole signature of torch's SDPA against torch's own outcome, at run time: every argument, passed by keyword
and (where torch allows it) by position, given every kind of value torch's argument parser takes or refuses
(Python bool, int, float, complex, str, bytes, Fraction, Decimal, objects with __float__ / __index__, numpy
scalars and arrays, 0-d / 1-d tensors of every kind, None, ...). Where torch raises, the engine and the global
patch raise the same exception type; where torch returns, they return the same shape and dtype (and the same
values where the call is deterministic). Directly (attention_core.scaled_dot_product_attention) and through the
global patch (attention_core.patched(force=True): every call the engine's).

The yardstick is torch's math backend, as in test_sdpa_refusals.py (the CPU's fused kernel differs from it in
corners the engine follows math on). The outcome is read from the torch installed, so the test adapts to its
version (2.5.1 and 2.14.1 are the ones checked).
Red before: scale as a 7th positional argument (and enable_gqa as an 8th) was accepted; a Fraction scale or
dropout_p was used; numpy bool and complex scalars and complex 0-d tensors were refused; zero query heads with
enable_gqa and an empty value (no heads, batch or keys) were refused or shaped differently.
"""
import decimal
import fractions
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_core as ac

g = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g),
           torch.randn(1, 2, 7, 8, generator=g))
MASK = torch.randn(6, 7, generator=g)


class FloatSubclass(float):
    pass


class IntSubclass(int):
    pass


class HasFloat:
    def __float__(self):
        return 0.5


class HasIndex:
    def __index__(self):
        return 1


# values of every kind torch's parser meets; each is tried in every argument
VALUES = {
    "None": None, "True": True, "False": False, "int 0": 0, "int 2": 2, "float 0": 0.0, "float 0.5": 0.5,
    "float 1": 1.0, "float nan": float("nan"), "float -0.5": -0.5, "Fraction": fractions.Fraction(1, 2),
    "Fraction 0": fractions.Fraction(0), "Decimal": decimal.Decimal("0.5"), "complex": 0.5 + 0j, "str": "0.5",
    "bytes": b"x", "list": [0.5], "tuple": (0.5,), "dict": {}, "object": object(), "float subclass": FloatSubclass(0.5),
    "int subclass": IntSubclass(1), "__float__": HasFloat(), "__index__": HasIndex(), "dtype": torch.float32,
    "np.float16": np.float16(0.5), "np.float32": np.float32(0.5), "np.float64": np.float64(0.5),
    "np.longdouble": np.longdouble(0.5), "np.int8": np.int8(1), "np.int64": np.int64(0), "np.uint8": np.uint8(1),
    "np.bool_ True": np.bool_(True), "np.bool_ False": np.bool_(False), "np.complex64": np.complex64(0.5),
    "np.complex128 imag": np.complex128(0.5 + 1j), "np 0-d array": np.array(0.5), "np 1-d array": np.array([0.5]),
    "tensor 0-d": torch.tensor(0.5), "tensor 0-d int": torch.tensor(1), "tensor 0-d bool": torch.tensor(True),
    "tensor 0-d f64": torch.tensor(0.5, dtype=torch.float64), "tensor 0-d half": torch.tensor(0.5, dtype=torch.half),
    "tensor 0-d complex": torch.tensor(0.5 + 0j), "tensor 0-d complex imag": torch.tensor(0.5 + 1j),
    "tensor 1-d": torch.tensor([0.5]), "tensor 0-d grad": torch.tensor(0.5, requires_grad=True),
    "tensor 0-d meta": torch.tensor(0.5, device="meta"), "mask tensor": MASK, "bool mask": MASK > 0,
    "q-shaped tensor": torch.randn(1, 4, 6, 8, generator=g), "k-shaped tensor": torch.randn(1, 2, 7, 8, generator=g),
}
NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS = dict(query=Q, key=K, value=V, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True)


def engine(*args, **kwargs):
    return ac.scaled_dot_product_attention(*args, **kwargs)


def through_patch(*args, **kwargs):
    with ac.patched(force=True):
        return F.scaled_dot_product_attention(*args, **kwargs)


ROUTES = {"engine": engine, "global patch": through_patch}


def torch_math(*args, **kwargs):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*args, **kwargs)


def outcome(fn, args, kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return None, e


def compare(args, kwargs, route):
    want, theirs = outcome(torch_math, args, kwargs)
    got, ours = outcome(ROUTES[route], args, kwargs)
    if theirs is not None:
        assert ours is not None, f"torch raises {type(theirs).__name__}: {theirs}; {route} returned"
        assert type(ours) is type(theirs), (f"torch raises {type(theirs).__name__} ({theirs}), {route} "
                                            f"{type(ours).__name__} ({ours})")
        return
    assert ours is None, f"torch returns; {route} raises {type(ours).__name__}: {ours}"
    assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device)
    again, _ = outcome(torch_math, args, kwargs)
    if torch.equal(torch.nan_to_num(again), torch.nan_to_num(want)):  # deterministic (no dropout drawn)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("name", NAMES)
def test_every_argument_by_keyword(name, value, route):
    kwargs = dict(DEFAULTS, **{name: VALUES[value]})
    compare((), kwargs, route)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("value", ["None", "float 0.5", "int 2", "True", "Fraction", "tensor 0-d", "mask tensor"])
@pytest.mark.parametrize("position", range(3, 8))
def test_every_argument_by_position(position, value, route):
    """torch takes query .. is_causal by position (6) and scale / enable_gqa by keyword only: a 7th or 8th
    positional argument is its TypeError, whatever the value."""
    args = [DEFAULTS[n] for n in NAMES[:position + 1]]
    args[position] = VALUES[value]
    kwargs = {n: DEFAULTS[n] for n in NAMES[position + 1:]}
    compare(tuple(args), kwargs, route)


def torch_divides_by_zero(hk, hv, gqa):
    """Under enable_gqa torch divides the query head count by the key and value head counts: a zero one ends the
    process (SIGFPE) unless torch returns its zeros for an empty value first (torch 2.14: for hv == 0; torch 2.5 has
    no such rule). Those cases are left out (the engine raises RuntimeError there)."""
    from attention_core.kernel.problem import torch_zeros_for_empty_value
    if not gqa or (hk != 0 and hv != 0):
        return False
    return not (hv == 0 and torch_zeros_for_empty_value())


# (query heads, key heads, value heads) with and without GQA
HEADS = [(hq, hk, hv, gqa) for hq, hk, hv, gqa in itertools.product((0, 2, 4), (0, 1, 2, 4), (0, 1, 2, 4),
                                                                     (False, True))
         if not torch_divides_by_zero(hk, hv, gqa)]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("hq,hk,hv,gqa", HEADS)
def test_head_counts_zero_included(hq, hk, hv, gqa, route):
    """Zero query heads with enable_gqa is torch's empty result; an empty value (no heads) is torch's zeros of the
    query's shape whatever the other head counts."""
    args = (torch.randn(1, hq, 6, 8, generator=g), torch.randn(1, hk, 7, 8, generator=g),
            torch.randn(1, hv, 7, 8, generator=g))
    compare(args, dict(enable_gqa=gqa), route)


EMPTY = {
    "no batch in key/value": ((2, 4, 6, 8), (0, 4, 7, 8), (0, 4, 7, 5)),
    "no keys, batch broadcast": ((1, 4, 6, 8), (2, 4, 0, 8), (2, 4, 0, 8)),
    "3-d, no key heads": ((3, 6, 8), (0, 7, 8), (0, 7, 8)),
    "no value dims": ((1, 4, 6, 8), (1, 4, 7, 8), (1, 4, 7, 0)),
    "empty value, head dims differ": ((1, 4, 6, 8), (1, 0, 7, 9), (1, 0, 7, 8)),
    "empty value, key longer": ((1, 4, 6, 8), (1, 0, 7, 8), (1, 0, 5, 8)),
    "empty key only": ((1, 4, 6, 8), (1, 4, 0, 8), (1, 4, 7, 8)),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("extra", [{}, {"is_causal": True}, {"dropout_p": 2.0}, {"attn_mask": torch.zeros(5, 3)},
                                   {"attn_mask": torch.zeros(6, 7, dtype=torch.float64)},
                                   {"attn_mask": torch.zeros(6, 7), "is_causal": True}], ids=str)
@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_value_as_torch(case, extra, route):
    args = tuple(torch.randn(s, generator=g) for s in EMPTY[case])
    compare(args, dict(extra), route)


def test_empty_value_zeros_keep_a_gradient_path():
    """torch's zeros for an empty value are connected to the inputs that need grad (zero gradients): so are the
    engine's."""
    from attention_core.kernel.problem import torch_zeros_for_empty_value
    if not torch_zeros_for_empty_value():
        pytest.skip(f"not applicable: torch {torch.__version__} has no zeros rule for an empty value (it computes)")
    q = torch.randn(1, 4, 6, 8, generator=g, requires_grad=True)
    k, v = torch.randn(1, 0, 7, 8), torch.randn(1, 0, 7, 8)
    want = torch_math(q, k, v)
    got = ac.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert got.requires_grad == want.requires_grad and torch.equal(got, want)
    (gq,) = torch.autograd.grad(got.sum(), q)
    assert torch.equal(gq, torch.zeros_like(q))
    out, lse = ac.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.shape == want.shape and lse.shape == want.shape[:-1] and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("call", ["missing value", "query twice", "unknown keyword", "no arguments",
                                  "scale and enable_gqa positional"])
def test_binding_errors(call, route):
    args, kwargs = {
        "missing value": ((Q, K), {}),
        "query twice": ((Q, K, V), {"query": Q}),
        "unknown keyword": ((Q, K, V), {"bogus": 1}),
        "no arguments": ((), {}),
        "scale and enable_gqa positional": ((Q, K, V, None, 0.0, False, None, True), {}),
    }[call]
    compare(args, kwargs, route)
