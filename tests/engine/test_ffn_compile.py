"""FFN Chunking inside torch.compile(fullgraph=True): the exactness check runs as plain Python while dynamo traces
(its verdict a constant of the graph), so the wrapper adds no graph break and no recompile, and a module that mixes
tokens still runs unchunked under compile."""
import torch
from torch._dynamo.utils import counters

from attention_core import chunk_ffn


class Block(torch.nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.ffn = ffn

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class MeanMixer(torch.nn.Module):
    """Token-wise MLP plus the mean over tokens: chunks see a different mean than the whole."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) + x.mean(dim=1, keepdim=True)


def compiled_runs(block, inputs):
    torch._dynamo.reset()
    counters.clear()
    try:
        c = torch.compile(block, backend="eager", fullgraph=True)
        outs = [c(x) for x in inputs]
        return outs, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()


def test_chunked_ffn_compiles_fullgraph_once_and_exact():
    torch.manual_seed(0)
    ffn = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    block = Block(ffn)
    inputs = [torch.randn(2, 40, 16) for _ in range(3)]
    refs = [block(x) for x in inputs]
    wrapper = chunk_ffn(ffn, chunks=4)
    outs, breaks, graphs = compiled_runs(block, inputs)
    assert breaks == {} and graphs == 1, (breaks, graphs)
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(outs, refs))
    assert wrapper.verified is True and wrapper.calls_chunked == 0  # decided while tracing; no count in-graph


def test_token_mixing_module_runs_unchunked_under_compile():
    torch.manual_seed(0)
    block = Block(MeanMixer())
    inputs = [torch.randn(2, 40, 16) for _ in range(2)]
    refs = [block(x) for x in inputs]
    wrapper = chunk_ffn(block.ffn, chunks=4)
    outs, breaks, graphs = compiled_runs(block, inputs)
    assert breaks == {} and graphs == 1, (breaks, graphs)
    assert wrapper.verified is False
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(outs, refs))


def test_an_eager_verdict_is_reused_by_the_trace():
    torch.manual_seed(0)
    ffn = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    block = Block(ffn)
    inputs = [torch.randn(2, 40, 16) for _ in range(2)]
    wrapper = chunk_ffn(ffn, chunks=4)
    refs = [block(x) for x in inputs]  # eager: checked on the real input, chunked
    assert wrapper.verified is True and len(wrapper.verdicts) == 1 and wrapper.calls_chunked == 2
    outs, breaks, graphs = compiled_runs(block, inputs)
    assert breaks == {} and graphs == 1, (breaks, graphs)
    # torch 2.5's dynamo cannot call the owner's weakref while tracing (the training flag reads None), so there the
    # trace makes its own check on random inputs instead of reusing the eager verdict: same answer, one more entry
    reused = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6)
    assert len(wrapper.verdicts) == (1 if reused else 2) and wrapper.calls_chunked == 2
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(outs, refs))


def test_the_traced_decision_chunks_any_signature_of_two_tokens_or_more():
    """What the trace decides per signature (ChunkedFFN.decide): a single token runs whole (nothing to split);
    two tokens already split into two exact pieces; a token-mixing module is never chunked."""
    torch.manual_seed(0)
    ffn = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    wrapper = chunk_ffn(ffn, chunks=4)
    cpu = torch.device("cpu")
    assert wrapper.decide((1, 1, 16), torch.float32, cpu, 1, False) == 0
    assert wrapper.decide((1, 2, 16), torch.float32, cpu, 1, False) == 2
    assert wrapper.decide((1, 3, 16), torch.float32, cpu, 1, False) == 3
    assert wrapper.decide((2, 40, 16), torch.float32, cpu, 1, False) == 4
    mixer = chunk_ffn(MeanMixer(), chunks=4)
    assert mixer.decide((2, 40, 16), torch.float32, cpu, 1, False) == 0


def test_an_eager_call_while_another_thread_compiles_runs_eagerly():
    """torch 2.14's torch.compiler.is_compiling() answers True on every thread while any thread compiles; the wrapper
    asks is_dynamo_compiling() (this thread's trace). A thread that calls the FFN eagerly while another thread is
    inside a real torch.compile trace (held there by a comptime callback) takes the eager path: checked on its real
    input, chunked and counted. Before: it took the traced path (no count, a verdict from random probes)."""
    import threading

    from torch._dynamo.comptime import comptime

    inside, release = threading.Event(), threading.Event()

    def hold(ctx):  # runs while dynamo traces `held`, on the compiling thread
        inside.set()
        release.wait(60)

    def held(x):
        comptime(hold)
        return x * 2

    torch.manual_seed(0)
    ffn = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        want = ffn(x)
    wrapper = chunk_ffn(ffn, chunks=4)
    torch._dynamo.reset()
    errors = []

    def compile_in_thread():
        try:
            torch.compile(held, backend="eager", fullgraph=True)(torch.randn(3))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=compile_in_thread)
    thread.start()
    try:
        assert inside.wait(60), "the other thread never reached its trace"
        with torch.no_grad():
            out = ffn(x)
        during = (wrapper.calls_chunked, list(wrapper.verdicts.items()))
    finally:
        release.set()
        thread.join(60)
        torch._dynamo.reset()
    assert errors == []
    assert torch.allclose(out, want, atol=1e-6)
    assert during == (1, [((("T", (2, 40, 16), torch.float32, torch.device("cpu")), ("tuple",), ("dict",), True),
                           True)])
