"""Sequence-parallel exact attention over torch.distributed: Ulysses (all-to-all) and ring (log-sum-exp merge).

Contract of both functions: P ranks of `group` each hold a contiguous slice of the sequence, q/k/v of shape
[B, H, N/P, D] in rank order along dim -2 (rank r holds tokens r*N/P .. (r+1)*N/P - 1), and each gets back its
slice of full attention over all N tokens, exactly (to fp32 rounding) what torch's SDPA gives on the gathered
tensors. attn_mask, when given, holds this rank's query rows and ALL N key columns (in global order):
broadcastable to [B, H, N/P, N] (a key-padding mask [B, 1, 1, N] costs nothing extra).

  Ulysses  all-to-all from sequence shards to head shards ([B, H/P, N, D]), the engine on full sequences, all-to-all
           back. Needs H (query heads) divisible by P. Moves 4 x B*H*N*D/P elements per rank per call (q, k, v, out;
           k, v less under GQA). Memory: the engine's O(N) on H/P heads.
  Ring     K/V blocks pass around the ring (rank r sends to r+1); each step's partial (out, lse) merges into the
           running result: lse = logaddexp(lse_a, lse_b), out = out_a e^(lse_a-lse) + out_b e^(lse_b-lse).
           Causal attention is load-balanced: internally the sequence is cut in 2P chunks and rank r works on
           chunks r and 2P-1-r ("zigzag"); the reorder is an all-to-all of q, k, v (and back of out) that the
           caller never sees. Backward passes K/V with their dK/dV accumulators around the ring the same way and
           one more hop home; each block's gradient comes from the recompute backward given the GLOBAL out and lse.
           Memory O(N/P) per rank. dropout_p > 0 raises NotImplementedError (use Ulysses).

Gradients: q, k, v, and a floating attn_mask with requires_grad (torch's dS, summed over the mask's broadcast
dims). A mask holds this rank's query rows, so its gradient is this rank's rows' part: for a mask without a row
dim (key padding [B, 1, 1, N]) shared by all ranks, the ranks' gradients sum to torch's gradient of that one mask
(all_reduce them, as for any replicated parameter). Ulysses gives such a mask its rows internally when it needs a
gradient ([B, H or 1, N/P, N] per rank for the duration of the call).
return_lse=True returns (out, lse) as the engine's scaled_dot_product_attention does: lse [B, H, N/P] this rank's
rows, the log-sum-exp of the scaled, masked scores over all N keys, float32 (float64 for float64), differentiable.

Every call first all-gathers a small description of each rank's inputs, so ranks that disagree (shapes, dtype,
flags) or a rank whose inputs or engine options (tier, memory_budget, an unknown keyword, ...) are malformed raise
a ValueError on every rank, with the same message (naming the rank(s) and the problem), before anything else is
sent. An error after that (out of
memory, no tile fitting memory_budget, on one rank or all, forward or backward) does not stop the communication
half way: the failing rank keeps passing its blocks until every posted send and receive has completed, then one
more small all_gather tells every rank; the failing rank re-raises its own exception, the others a RuntimeError
naming it. The process group stays usable for the next call. Every collective runs under the process group's
timeout (init_process_group(timeout=...)), so a rank that never calls makes the others raise instead of hanging.

Zero query heads give torch's empty result (out [B, 0, N/P, Ev], lse [B, 0, N/P], zero gradients) with no exchange
after the agreement. Across ranks (P > 1) torch.func transforms (grad, vmap, jvp, jacrev, hessian, ...) and
forward-mode AD dual tensors are refused in the agreement: a NotImplementedError on every rank, naming the function
and the transform (the exchanges have no batching or forward-mode rule; loss.backward() is exact); with P = 1 the
call is the engine's own and every transform works. torch.compile runs both functions eagerly, outside the graph
(torch.compiler.disable: a graph break; fullgraph=True raises, naming the function).
"""
from .flash_layout import flash_layout_attention
from .ring import ring_attention, zigzag_chunks
from .ulysses import ulysses_attention

# one file a duty: blocks.py (the per-block (out, lse) primitive and the merge), group.py (the process-group
# plumbing both share: agreement, settling errors, checks, all-to-all), ulysses.py, ring.py, flash_layout.py
__all__ = ["ulysses_attention", "ring_attention", "zigzag_chunks", "flash_layout_attention"]
