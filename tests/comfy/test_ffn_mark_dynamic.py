"""FFN Chunking on ComfyUI's own Wan 2.x block (comfy.ldm.wan.model.WanAttentionBlock, t2v) compiled with
torch._dynamo.mark_dynamic on the block's input (issue 30.5): the FFN sees `addcmul(e3, norm2(x), 1 + e4)`, not the
marked x, and before the fix the wrapper made its sizes concrete: ConstraintViolationError, with fullgraph True and
False. Now a marked token count runs the FFN unchunked in the graph and a marked batch keeps it chunked; one graph
for two values of the marked size, outputs equal to the uncompiled block without FFN Chunking. The block's attention
is ComfyUI's attention_pytorch (what --use-pytorch-cross-attention selects): the CPU default, sub-quadratic
attention, specializes the token count itself (with or without this pack)."""
import pytest
import torch
from torch._dynamo.utils import counters

from comfy_harness import require_comfy

pytestmark = pytest.mark.comfy_inprocess

DIM, FFN_DIM, HEADS, CONTEXT = 32, 96, 2, 7


@pytest.fixture
def wan_block(pack, monkeypatch):
    require_comfy()
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    import comfy.ops
    monkeypatch.setattr(wan, "optimized_attention", attention.attention_pytorch)
    settings = {"operations": comfy.ops.disable_weight_init, "device": "cpu", "dtype": torch.float32}
    block = wan.WanAttentionBlock("t2v_cross_attn", DIM, FFN_DIM, HEADS, operation_settings=settings).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return block


def calls_marked(axis):
    """(x, e, freqs, context) for token counts 40 and 41 (x and the RoPE table marked on their token axis), or for
    batches 2 and 3 (every batched argument marked on axis 0); freqs in WanModel.rope_encode's layout."""
    g = torch.Generator().manual_seed(1)
    sizes = [(2, 40), (2, 41)] if axis == 1 else [(2, 40), (3, 40)]
    calls = []
    for b, n in sizes:
        x, e = torch.randn(b, n, DIM, generator=g), torch.randn(b, 6, DIM, generator=g)
        freqs, context = torch.randn(1, n, 1, DIM // HEADS // 2, 2, 2, generator=g), torch.randn(b, CONTEXT, DIM,
                                                                                                   generator=g)
        for t in ((x, freqs) if axis == 1 else (x, e, context)):
            torch._dynamo.mark_dynamic(t, axis)
        calls.append((x, e, freqs, context))
    return calls


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("axis", [1, 0], ids=["token", "batch"])
def test_comfy_wan_block_with_a_marked_input_compiles_with_ffn_chunking(pack, wan_block, axis, fullgraph):
    from tiled_attention_pack.attention_core import chunk_ffn, unchunk_ffn
    calls = calls_marked(axis)
    wrapper = chunk_ffn(wan_block.ffn, chunks=4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(wan_block, backend=backend, fullgraph=fullgraph)
        with torch.no_grad():
            outs = [compiled(*args) for args in calls]
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    narrows = sum(1 for n in graphs[0].graph.nodes if n.op in ("call_method", "call_function")
                  and getattr(n.target, "__name__", n.target) == "narrow")
    assert len(graphs) == 1 and breaks == {}, (len(graphs), breaks)
    assert narrows == (0 if axis == 1 else 2 * 4)  # 4 pieces cut out and written back; none for a marked count
    unchunk_ffn(wan_block.ffn)
    with torch.no_grad():
        for args, out in zip(calls, outs):
            want = wan_block(*args)
            assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert wrapper.calls_chunked == 0
