"""Exact token-chunked feed-forward: y[:, a:b] = ffn(x[:, a:b]), since a feed-forward acts on each token alone.

The hidden activation (tokens x 4*dim, often the largest tensor of a video DiT block) then lives one chunk at a
time. Chunking is only exact for a module that really is token-wise, so each new call signature (input shape,
dtype, device, the extra arguments' shapes, train/eval mode) is checked before it is ever chunked; a module that
fails, or a call the check cannot decide, runs unchunked.

    chunk_ffn(module, chunks=0, dim=1) -> ChunkedFFN    install the wrapper as module.forward (0 chunks: auto)
    unchunk_ffn(module)                                  remove it

One file per duty of the wrapper:
    wrapper.py     ChunkedFFN: the call (eager and under torch.compile), chunk_ffn / unchunk_ffn
    signature.py   which calls can be chunked (the token axis, per-token arguments) and a call's signature
    chunking.py    how many chunks (from free memory), the pieces, the chunked computation
    exactness.py   the check that chunking is exact for this module (two token partitions agree)
    state.py       the verdicts per signature, and the registry a compiled graph finds its wrapper by
    traced_sizes.py  under torch.compile: the input's sizes as the trace knows them, and which must stay symbolic
"""
from .wrapper import ChunkedFFN, chunk_ffn, unchunk_ffn

__all__ = ["ChunkedFFN", "chunk_ffn", "unchunk_ffn"]
