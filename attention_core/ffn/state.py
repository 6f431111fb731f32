"""The state of FFN chunking: one verdict per call signature, and the registry a compiled graph finds its wrapper by.

Verdicts (True: chunk, False: run unchunked) are kept per wrapper for at most MAX_SIGNATURES distinct signatures;
the least recently used is forgotten first.

Inside torch.compile the wrapper reads and writes no Python state in the graph (fullgraph=True, no recompile):
the chunk count and the verdict are decided once per traced signature as plain Python while dynamo traces
(torch.compiler.assume_constant_result), from an eager call's verdict when there is one, else from the check on two
seeded random inputs of the call's shape (the real input does not exist while tracing). torch <= 2.5's
assume_constant_result takes only constant arguments, so the wrapper travels as an int key (`register`) and dtype
and device as strings.
"""
import itertools
import operator
import weakref

import torch

# verdicts kept per wrapper (distinct call signatures); the oldest is forgotten first
MAX_SIGNATURES = 64

_TRACED_WRAPPERS = weakref.WeakValueDictionary()  # key -> ChunkedFFN
_trace_keys = itertools.count(1)


def remember(verdicts, key, verdict) -> None:
    """Record the verdict of a signature, forgetting the oldest beyond MAX_SIGNATURES."""
    verdicts[key] = verdict
    while len(verdicts) > MAX_SIGNATURES:
        verdicts.popitem(last=False)


def register(wrapper) -> int:
    """An int key for _decide_by_key (a compiled graph's decision is looked up by a constant, not the object)."""
    key = next(_trace_keys)
    _TRACED_WRAPPERS[key] = wrapper
    return key


def decide_while_tracing(wrapper, shape, dtype, device, dim, training) -> int:
    """wrapper.decide(...) as a constant of the graph; shape and dim concrete ints (the caller specializes them).
    The key is an int attribute, which dynamo may trace as symbolic (dynamic=True): operator.index makes it a
    constant."""
    return _decide_by_key(operator.index(wrapper._trace_key), tuple(shape), str(dtype).replace("torch.", ""),
                          str(device), dim, training)


@torch.compiler.assume_constant_result
def _decide_by_key(key, shape, dtype_name, device_name, dim, training) -> int:
    """Run by dynamo as plain Python at trace time; its result is a constant of the graph."""
    wrapper = _TRACED_WRAPPERS[key]
    with torch.no_grad():
        return wrapper.decide(shape, getattr(torch, dtype_name), torch.device(device_name), dim, training)
