"""Attention calls counted where the engine's work happens: the implementation of tiled_attention::fwd
(autograd.py) adds one to the count key its caller passed (`count_as`, "" counts nothing).

The op's implementation runs in eager calls and inside torch.compile graphs alike (the traced graph holds the op, and
every run of the graph runs its implementation), so a router that passes a key is counted by what really ran, with
or without compile. A router never counts its engine calls itself (that would count eager calls twice). A key
traced into a graph is traced_key(key): the same name plus COMPILED, so the compiled calls can be told apart.

Counts live in this module of this copy of the engine (a second copy imported under another name has its own),
start empty and are changed only by add() and reset(); all thread-safe and lock-free, so re-entrant: a signal
handler or a trace function that reads the counts (attention_core.patch.stats(), the report) or makes a counted call
while this thread is inside add(), calls() or counted() neither waits on itself nor loses a count. Each key's count is
an itertools.count, advanced by one C call (next(), atomic under the GIL: nothing can run between its read and its
write), and every reader works on a copy of the table taken by one C call (dict.copy()).
"""
from __future__ import annotations

import itertools

import torch

COMPILED = "@compiled"  # suffix of a key traced into a torch.compile graph
_counts: dict = {}  # key -> itertools.count whose next value is the number of calls so far


def add(key: str) -> None:
    """One call under `key` (nothing for "")."""
    if not key:
        return
    counter = _counts.get(key)
    if counter is None:
        counter = _counts.setdefault(key, itertools.count())  # one counter per key, whoever adds first
    next(counter)


def _value(counter) -> int:
    """The calls an itertools.count has counted: its next value, read from its repr ("count(5)") without advancing it
    (its pickling support, __reduce__, is deprecated in Python 3.12 and gone in 3.14)."""
    return int(repr(counter)[6:-1]) if counter is not None else 0


def traced_key(key: str) -> str:
    """`key` for a call made now: key + COMPILED while torch.compile traces the call (dynamo keeps the string in the
    graph as a constant), key itself in an eager call; "" stays ""."""
    if key and torch.compiler.is_dynamo_compiling():
        return key + COMPILED
    return key


def calls(key: str) -> tuple:
    """(all, compiled): the calls counted under `key`, eager and compiled together, and the compiled ones alone."""
    table = _counts.copy()
    compiled = _value(table.get(key + COMPILED))
    return _value(table.get(key)) + compiled, compiled


def counted(prefix: str) -> dict:
    """{key: (all, compiled)} of every key starting with `prefix` that has calls (keys without COMPILED)."""
    table = _counts.copy()
    keys = {k[:-len(COMPILED)] if k.endswith(COMPILED) else k for k in table if k.startswith(prefix)}
    out = {}
    for k in keys:
        compiled = _value(table.get(k + COMPILED))
        out[k] = (_value(table.get(k)) + compiled, compiled)
    return {k: c for k, c in out.items() if c[0]}


def reset(prefix: str) -> None:
    """Forget the counts of every key starting with `prefix` (their compiled keys included)."""
    for key in [k for k in _counts.copy() if k.startswith(prefix)]:
        _counts.pop(key, None)
