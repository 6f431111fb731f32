"""FFN Chunking inside a DiT block compiled with torch._dynamo.mark_dynamic on the block's input (issue 30.5).

The FFN of a DiT block sees an intermediate (a modulated norm of the residual stream), not the marked input, so the
wrapper cannot read the mark off its own input: it reads it off the trace (attention_core/ffn/traced_sizes.py). A
marked token count stays symbolic (the FFN runs unchunked in the graph: the pieces need a concrete count); a marked
batch stays symbolic and the FFN is still chunked (the pieces cut the token axis only). Before, the wrapper made every
size concrete and the compile failed with ConstraintViolationError, with fullgraph True and False. Each case: one
graph for two values of the marked size, no graph break, outputs equal to the uncompiled block without the wrapper
(token-wise pieces only change a GEMM's blocking). Two blocks: the structure of ComfyUI's Wan 2.x block
(comfy.ldm.wan.model.WanAttentionBlock, t2v: adaLN modulation, self- and cross-attention through SDPA, the FFN on
`addcmul(shift, norm2(x), 1 + scale)`) written here, so it runs on every supported torch, and diffusers'
WanTransformerBlock itself. dynamic=True, automatic dynamic shapes and maybe_mark_dynamic keep chunking (each token
count its own graph)."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from attention_core import chunk_ffn, unchunk_ffn

DIM, HEADS, FFN_DIM, CONTEXT = 32, 2, 96, 7


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(torch.nn.Module):
    """comfy.ldm.wan.model.WanSelfAttention / WanT2VCrossAttention: q, k with RMSNorm over all heads, SDPA, o."""
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x, context):
        b = x.shape[0]
        heads = lambda t: t.view(b, -1, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.norm_q(self.q(x))), heads(self.norm_k(self.k(context))), heads(self.v(context))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, DIM))


class WanLikeBlock(torch.nn.Module):
    """comfy.ldm.wan.model.WanAttentionBlock's forward (t2v, e of shape [B, 6, C], no RoPE)."""
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM, 1e-6, elementwise_affine=False)
        self.self_attn, self.cross_attn = Attention(), Attention()
        self.norm3 = torch.nn.Identity()
        self.norm2 = torch.nn.LayerNorm(DIM, 1e-6, elementwise_affine=False)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(DIM, FFN_DIM), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(FFN_DIM, DIM))
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, DIM) / DIM ** 0.5)

    def forward(self, x, e, context):
        e = (self.modulation + e).chunk(6, dim=1)
        h = torch.addcmul(e[0], self.norm1(x), 1 + e[1])
        x = torch.addcmul(x, self.self_attn(h, h), e[2])
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn(torch.addcmul(e[3], self.norm2(x), 1 + e[4]))
        return torch.addcmul(x, y, e[5])


def wan_like():
    torch.manual_seed(0)
    return WanLikeBlock().eval(), lambda b, n, g: (torch.randn(b, n, DIM, generator=g),
                                                   torch.randn(b, 6, DIM, generator=g),
                                                   torch.randn(b, CONTEXT, DIM, generator=g))


def diffusers_wan():
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        pytest.skip("not applicable: torch 2.5's dynamo cannot compile diffusers' WanTransformerBlock with "
                    "mark_dynamic even without FFN Chunking (Unsupported call_method SetVariable.issuperset)")
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    torch.manual_seed(0)
    block = WanTransformerBlock(dim=DIM, ffn_dim=FFN_DIM, num_heads=HEADS).eval()
    return block, lambda b, n, g: (torch.randn(b, n, DIM, generator=g), torch.randn(b, CONTEXT, DIM, generator=g),
                                   torch.randn(b, 6, DIM, generator=g), None)


BLOCKS = {"wan_like": wan_like, "diffusers_wan": diffusers_wan}


def graph_narrows(gm):
    """How many narrow calls a dynamo graph holds: ChunkedFFN cuts each piece out of the input and writes its output
    into a slice of the result with narrow, so k pieces are 2k narrows (the blocks themselves have none)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_method", "call_function")
               and getattr(n.target, "__name__", n.target) == "narrow")


def compile_runs(block, calls, fullgraph, **compile_kwargs):
    """Compiled outputs of `calls` (argument tuples) with a backend that keeps dynamo's graphs: (outputs, graphs,
    graph breaks)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    try:
        c = torch.compile(block, backend=backend, fullgraph=fullgraph, **compile_kwargs)
        with torch.no_grad():
            outs = [c(*args) for args in calls]
        return outs, graphs, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def marked_calls(make, axis):
    """Two calls differing in the marked axis: token counts 40 and 41, or batches 2 and 3; each tensor argument
    is marked on that axis when its size there follows it (the token axis of x only: e and the context have their
    own lengths)."""
    g = torch.Generator().manual_seed(5)
    sizes = [(2, 40), (2, 41)] if axis == 1 else [(2, 40), (3, 40)]
    calls = [make(b, n, g) for b, n in sizes]
    for args in calls:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (axis == 0 or i == 0):
                torch._dynamo.mark_dynamic(a, axis)
    return calls


def assert_equal_to_plain(block, calls, outs):
    """Each compiled output equals the uncompiled block's without the wrapper (max diff <= 1e-5 x magnitude)."""
    unchunk_ffn(block.ffn)
    with torch.no_grad():
        for args, out in zip(calls, outs):
            want = block(*args)
            assert out.shape == want.shape
            assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max()), float((out - want).abs().max())


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("axis", [1, 0], ids=["token", "batch"])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_a_mark_on_the_blocks_input_compiles_with_one_graph_and_plain_results(kind, axis, fullgraph):
    """A mark on the block's token axis: one graph, the FFN unchunked in it (no narrow), no verdict taken. A mark on
    its batch axis: one graph, the FFN chunked in it (4 pieces), decided once at the traced batch. Before: the
    wrapper made every size of the FFN's input concrete: ConstraintViolationError."""
    block, make = BLOCKS[kind]()
    wrapper = chunk_ffn(block.ffn, chunks=4)
    calls = marked_calls(make, axis)
    outs, graphs, breaks = compile_runs(block, calls, fullgraph)
    assert len(graphs) == 1 and breaks == {}, (len(graphs), breaks)
    if axis == 1:
        assert graph_narrows(graphs[0]) == 0 and wrapper.verdicts == {}
    else:
        assert graph_narrows(graphs[0]) == 2 * 4
        assert [k[0][1] for k, v in wrapper.verdicts.items() if v] == [(2, 40, DIM)]
    assert wrapper.calls_chunked == 0
    assert_equal_to_plain(block, calls, outs)


@pytest.mark.parametrize("mode", ["dynamic_true", "automatic", "maybe_mark_dynamic"])
def test_other_dynamic_modes_chunk_each_token_count_in_its_own_graph(mode):
    """dynamic=True, automatic dynamic shapes (the second token count) and maybe_mark_dynamic leave the token count
    free to specialize: each token count compiles its own graph with the FFN chunked in 4 pieces, exactly."""
    block, make = wan_like()
    chunk_ffn(block.ffn, chunks=4)
    g = torch.Generator().manual_seed(5)
    calls = [make(2, n, g) for n in (40, 41)]
    if mode == "maybe_mark_dynamic":
        for args in calls:
            torch._dynamo.maybe_mark_dynamic(args[0], 1)
    outs, graphs, breaks = compile_runs(block, calls, True, dynamic=True if mode == "dynamic_true" else None)
    assert breaks == {} and len(graphs) == 2
    assert [graph_narrows(gm) for gm in graphs] == [2 * 4, 2 * 4]
    assert_equal_to_plain(block, calls, outs)


def test_a_mark_with_a_range_on_the_batch_keeps_the_range():
    """mark_dynamic(x, 0, min=2, max=8) (torch >= 2.6; 2.5 has no range): the chunked graph adds no guard that
    narrows the batch's range (dynamo would raise): one graph for batches 2 and 3."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        pytest.skip("not applicable: torch 2.5's mark_dynamic takes no min/max")
    block, make = wan_like()
    chunk_ffn(block.ffn, chunks=4)
    g = torch.Generator().manual_seed(5)
    calls = [make(b, 40, g) for b in (2, 3)]
    for args in calls:
        for a in args:
            torch._dynamo.mark_dynamic(a, 0, min=2, max=8)
    outs, graphs, breaks = compile_runs(block, calls, True)
    assert len(graphs) == 1 and breaks == {} and graph_narrows(graphs[0]) == 2 * 4
    assert_equal_to_plain(block, calls, outs)


def test_a_trace_whose_marks_cannot_be_read_runs_every_symbolic_token_count_unchunked(monkeypatch):
    """Where dynamo's record of the marks cannot be read (its internals moved in some torch), every symbolic size
    counts as marked: under dynamic=True the FFN then runs unchunked in one graph for both token counts, never a
    failed compile; sizes that are not symbolic still chunk (dynamic=False)."""
    from torch._dynamo.comptime import ComptimeContext

    def moved(self):
        raise AttributeError("moved")

    monkeypatch.setattr(ComptimeContext, "_i_will_not_complain_if_bc_breaks_InstructionTranslator", moved)
    block, make = wan_like()
    chunk_ffn(block.ffn, chunks=4)
    g = torch.Generator().manual_seed(5)
    calls = [make(2, n, g) for n in (40, 41)]
    outs, graphs, breaks = compile_runs(block, calls, True, dynamic=True)
    assert breaks == {} and len(graphs) == 1 and graph_narrows(graphs[0]) == 0
    assert_equal_to_plain(block, calls, outs)
    chunk_ffn(block.ffn, chunks=4)
    outs, graphs, breaks = compile_runs(block, calls, True, dynamic=False)
    assert breaks == {} and [graph_narrows(gm) for gm in graphs] == [2 * 4, 2 * 4]
    assert_equal_to_plain(block, calls, outs)


def test_a_trace_whose_sizes_cannot_be_read_runs_unchunked(monkeypatch):
    """When the FFN input's sizes cannot be read off the trace at all, nothing is decided: the FFN runs unchunked in
    the graph, no verdict, exact."""
    from attention_core.ffn import traced_sizes

    def unreadable(fake, marked):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(traced_sizes, "sizes_of", unreadable)
    block, make = wan_like()
    wrapper = chunk_ffn(block.ffn, chunks=4)
    g = torch.Generator().manual_seed(5)
    calls = [make(2, 40, g)]
    outs, graphs, breaks = compile_runs(block, calls, True)
    assert breaks == {} and len(graphs) == 1 and graph_narrows(graphs[0]) == 0 and wrapper.verdicts == {}
    assert_equal_to_plain(block, calls, outs)


def test_sizes_are_taken_once_and_only_by_their_wrapper():
    """traced_sizes.note leaves one record per thread for one wrapper key: another key, or a second take, gets
    None (then the call runs unchunked rather than on another call's sizes)."""
    from attention_core.ffn import traced_sizes
    x = torch.randn(2, 5, 3)
    traced_sizes.note(7, x)
    assert traced_sizes.take(8) is None and traced_sizes.take(7) is None
    traced_sizes.note(7, x)
    assert traced_sizes.take(7) == traced_sizes.Sizes((2, 5, 3))
    assert traced_sizes.take(7) is None


def test_sizes_of_symbolic_fakes():
    """sizes_of on a fake tensor with symbolic sizes (a ShapeEnv of its own): values are the sizes' trace-time
    values; a size whose symbol is marked is pinned, another symbolic size is not; with the marks unknown every
    symbolic size is pinned; a concrete size is a plain one; an unbacked size gives None."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from attention_core.ffn import traced_sizes
    shape_env = ShapeEnv()
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    mode = FakeTensorMode(shape_env=shape_env)
    fake = mode.from_tensor(torch.empty(2, 40, 16), source=ConstantSource("x"), symbolic_context=dynamic)
    tokens = fake.shape[1].node.expr
    assert traced_sizes.sizes_of(fake, {tokens}) == traced_sizes.Sizes((2, 40, 16), frozenset({0, 1}),
                                                                        frozenset({1}))
    assert traced_sizes.sizes_of(fake, None).pinned == frozenset({0, 1})
    assert traced_sizes.sizes_of(fake, set()).pinned == frozenset()
    with mode:
        unbacked = torch.empty(shape_env.create_unbacked_symint(), 3)
        sliced = fake.narrow(1, 0, 8)
    assert traced_sizes.sizes_of(sliced, {tokens}) == traced_sizes.Sizes((2, 8, 16), frozenset({0}), frozenset())
    assert traced_sizes.sizes_of(unbacked, set()) is None
