"""Attention calls counted where the engine's work happens: the implementation of tiled_attention::fwd
(autograd.py) adds one to the count key its caller passed (`count_as`, "" counts nothing).

The op's implementation runs in eager calls and inside torch.compile graphs alike (the traced graph holds the op, and
every run of the graph runs its implementation), so a router that passes a key is counted by what really ran, with
or without compile. A router never counts its engine calls itself (that would count eager calls twice). A key
traced into a graph is traced_key(key): the same name plus COMPILED, so the compiled calls can be told apart.

Counts live in this module of this copy of the engine (a second copy imported under another name has its own),
start empty and are changed only by add() and reset(); all thread-safe.
"""
from __future__ import annotations

import threading

import torch

COMPILED = "@compiled"  # suffix of a key traced into a torch.compile graph
_lock = threading.Lock()
_counts: dict = {}  # key -> calls


def add(key: str) -> None:
    """One call under `key` (nothing for "")."""
    if not key:
        return
    with _lock:
        _counts[key] = _counts.get(key, 0) + 1


def traced_key(key: str) -> str:
    """`key` for a call made now: key + COMPILED while torch.compile traces the call (dynamo keeps the string in the
    graph as a constant), key itself in an eager call; "" stays ""."""
    if key and torch.compiler.is_dynamo_compiling():
        return key + COMPILED
    return key


def calls(key: str) -> tuple:
    """(all, compiled): the calls counted under `key`, eager and compiled together, and the compiled ones alone."""
    with _lock:
        compiled = _counts.get(key + COMPILED, 0)
        return _counts.get(key, 0) + compiled, compiled


def counted(prefix: str) -> dict:
    """{key: (all, compiled)} of every key starting with `prefix` that has calls (keys without COMPILED)."""
    with _lock:
        keys = {k[:-len(COMPILED)] if k.endswith(COMPILED) else k for k in _counts if k.startswith(prefix)}
        return {k: (_counts.get(k, 0) + _counts.get(k + COMPILED, 0), _counts.get(k + COMPILED, 0)) for k in keys}


def reset(prefix: str) -> None:
    """Forget the counts of every key starting with `prefix` (their compiled keys included)."""
    with _lock:
        for key in [k for k in _counts if k.startswith(prefix)]:
            del _counts[key]
