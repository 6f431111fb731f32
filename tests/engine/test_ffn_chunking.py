"""Exact FFN chunking: token-wise modules are chunked exactly; anything else runs as the plain module would."""
import copy

import pytest
import torch

import attention_core.ffn.chunking as chunking_mod
from attention_core import ChunkedFFN, chunk_ffn, unchunk_ffn


def mlp(dim=16, hidden=64, seed=11):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(hidden, dim))


class TokenMixer(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)


class MeanMixer(torch.nn.Module):
    """Token-wise MLP plus the mean over tokens: what a chunk sees differs from the whole."""
    def __init__(self):
        super().__init__()
        self.mlp = mlp(8, 32)

    def forward(self, x):
        return self.mlp(x) + x.mean(dim=1, keepdim=True)


def test_chunk_ffn_exact_and_keys_untouched():
    ffn = mlp()
    x = torch.randn(2, 50, 16)
    ref = ffn(x)
    keys = list(ffn.state_dict())
    w = chunk_ffn(ffn, chunks=7)
    out = ffn(x)
    assert torch.allclose(out, ref, atol=1e-6)
    assert w.verified and w.calls_chunked == 1 and list(ffn.state_dict()) == keys
    assert w.hidden == 64
    out.sum().backward()  # gradients flow through the chunks
    assert ffn[0].weight.grad is not None
    unchunk_ffn(ffn)
    assert "forward" not in ffn.__dict__


def test_chunk_ffn_refuses_token_mixing_modules():
    m = TokenMixer()
    w = chunk_ffn(m, chunks=4)
    x = torch.randn(1, 32, 8)
    assert torch.allclose(m(x), x - x.mean(dim=1, keepdim=True))
    assert w.verified is False and w.calls_chunked == 0


@pytest.mark.parametrize("first", ["one_token", "identical_leading", "all_identical", "repeated_blocks"])
def test_mixing_is_caught_whatever_the_first_call(first):
    """The old check was skipped for a 1-token first call, looked at 8 tokens only and was fooled by identical
    leading tokens, then trusted its verdict forever: later calls came out off by ~0.6."""
    torch.manual_seed(3)
    m = MeanMixer()
    x = torch.randn(1, 64, 8)
    if first == "one_token":
        warm = torch.randn(1, 1, 8)
    elif first == "identical_leading":
        warm = torch.cat([torch.zeros(1, 16, 8), torch.randn(1, 48, 8) + 1], dim=1)
    elif first == "all_identical":
        warm = torch.ones(1, 64, 8)
    else:  # [a, b, a, b]: every equal-length chunk has the same mean as the whole
        ab = torch.randn(1, 16, 8)
        warm = ab.repeat(1, 4, 1)
    chunk_ffn(m, chunks=4)
    for inp in (warm, x):
        with torch.no_grad():
            got = m(inp)
            want = type(m).forward(m, inp)
        assert (got - want).abs().max() < 1e-5, first


def test_verdict_is_per_signature_and_reset_for_a_new_forward():
    m = MeanMixer()
    w = chunk_ffn(m, chunks=4)
    x = torch.randn(1, 40, 8)
    m(x)
    assert w.verified is False
    w.forward = mlp(8, 32)  # another function: old verdicts dropped
    assert w.verified is None
    y = torch.randn(1, 40, 8)
    assert torch.allclose(m(y), w.forward(y), atol=1e-6) and w.verified is True


def test_deepcopy_computes_with_its_own_weights():
    ffn = mlp()
    chunk_ffn(ffn, chunks=4)
    x = torch.randn(1, 24, 16)
    ema = copy.deepcopy(ffn)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    assert isinstance(ema.__dict__["forward"], ChunkedFFN)
    assert ema.forward.forward.__self__ is ema
    want = torch.nn.Sequential.forward(ema, x)
    assert torch.allclose(ema(x), want, atol=1e-6)
    assert not torch.allclose(ffn(x), want, atol=1e-3)


def test_output_token_count_changes_falls_back():
    class Pool(torch.nn.Module):  # halves the tokens
        def forward(self, x):
            return x.reshape(x.shape[0], x.shape[1] // 2, 2, x.shape[2]).mean(2)

    class Drop(torch.nn.Module):  # drops the first token
        def forward(self, x):
            return x[:, 1:] * 2

    for module in (Pool(), Drop()):
        x = torch.randn(2, 32, 8)
        want = module(x)
        chunk_ffn(module, chunks=4)
        got = module(x)
        assert got.shape == want.shape and torch.equal(got, want), type(module).__name__


class BNMixer(torch.nn.Module):
    """BatchNorm over (batch, tokens) per feature: train-mode statistics mix the tokens."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)


def test_check_leaves_state_as_one_plain_call():
    torch.manual_seed(5)
    ref, m = BNMixer().train(), BNMixer().train()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 32, 8)
    want = ref(x)
    chunk_ffn(m, chunks=4)
    got = m(x)
    assert torch.allclose(got, want, atol=1e-6)
    assert int(m.bn.num_batches_tracked) == 1
    assert torch.allclose(m.bn.running_mean, ref.bn.running_mean) and torch.allclose(m.bn.running_var,
                                                                                     ref.bn.running_var)


def test_check_leaves_counters_and_hooks_alone():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(8, 8)
            self.calls, self.seen = 0, []

        def forward(self, x):
            self.calls += 1
            self.seen.append(x.shape[1])
            return self.inner(x)

    hook_calls = []
    m = Counting()
    m.inner.register_forward_hook(lambda mod, i, o: hook_calls.append(i[0].shape[1]))
    chunk_ffn(m, chunks=4)
    x = torch.randn(1, 32, 8)
    assert torch.allclose(m(x), m.inner(x), atol=1e-6)
    # the check ran the forward 4 times (2 partitions x 2 probes); only the real chunked call's 4 pieces remain
    assert m.calls == 4 and m.seen == [8, 8, 8, 8]
    assert hook_calls == [8, 8, 8, 8, 32]  # the 4 pieces, then our own m.inner(x) above


@pytest.mark.parametrize("case", ["2d_dim1", "tuple_out", "per_token_kwarg", "bad_dim", "non_tensor"])
def test_calls_chunking_cannot_represent_run_plain(case):
    lin = torch.nn.Linear(8, 8)
    if case == "2d_dim1":
        module, x, kw = lin, torch.randn(20, 8), {}
    elif case == "tuple_out":
        class Tup(torch.nn.Module):
            def forward(self, x):
                return lin(x), x.sum()
        module, x, kw = Tup(), torch.randn(1, 20, 8), {}
    elif case == "per_token_kwarg":
        class Mod(torch.nn.Module):
            def forward(self, x, scale=None):
                return lin(x) * scale
        module, x, kw = Mod(), torch.randn(1, 20, 8), {"scale": torch.randn(1, 20, 1)}
    elif case == "bad_dim":
        module, x, kw = lin, torch.randn(1, 20, 8), {}
    else:
        class Lst(torch.nn.Module):
            def forward(self, xs):
                return [lin(t) for t in xs]
        module, x, kw = Lst(), [torch.randn(1, 4, 8)], {}
    want = module(x, **kw)
    chunk_ffn(module, chunks=4, dim=7 if case == "bad_dim" else 1)
    got = module(x, **kw)
    if isinstance(want, torch.Tensor):
        assert torch.allclose(got, want, atol=1e-6)
    else:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_chunk_ffn_auto_count_from_memory(monkeypatch):
    monkeypatch.setattr(chunking_mod, "free_memory", lambda d: 1 << 20)
    ffn = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    w = chunk_ffn(ffn, chunks=0)
    x = torch.randn(1, 4096, 32)
    assert w.chunk_count(x) > 1
    assert torch.allclose(ffn(x), w.forward(x), atol=1e-6)


def test_steady_state_runs_the_check_once_per_signature(monkeypatch):
    ffn = mlp()
    w = chunk_ffn(ffn, chunks=4)
    checks = []
    real = w._check
    monkeypatch.setattr(w, "_check", lambda *a: checks.append(1) or real(*a))
    for _ in range(3):
        ffn(torch.randn(1, 32, 16))
    ffn(torch.randn(1, 33, 16))
    assert len(checks) == 2 and w.calls_chunked == 4


def test_non_finite_outputs_of_a_token_wise_module_still_chunk():
    class Log(torch.nn.Module):  # NaN for negative inputs, -inf at 0: token-wise all the same
        def forward(self, x):
            return torch.log(x)

    m = Log()
    w = chunk_ffn(m, chunks=4)
    x = torch.randn(1, 32, 8)
    x[0, 3, 0] = 0.0
    got, want = m(x), torch.log(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert w.verified is True and w.calls_chunked == 1


@pytest.mark.parametrize("n,p_sizes", [(10, [4, 6]), (7, [7]), (9, [3, 3, 3]), (5, [1, 1, 3]), (16, [5, 11]),
                                       (64, [16, 16, 16, 16])])
def test_the_second_partition_cuts_inside_every_piece_of_the_first(n, p_sizes):
    """The token-mixing check runs the FFN on two partitions; it can only see mixing inside a piece of the first
    if the second cuts that piece (a module that mixes tokens gives different outputs then)."""
    from itertools import accumulate

    from attention_core.ffn.exactness import _pieces_q
    q_sizes = _pieces_q(n, p_sizes)
    assert sum(q_sizes) == n and all(s > 0 for s in q_sizes)
    q_cuts = set(accumulate(q_sizes[:-1]))
    start = 0
    for s in p_sizes:
        if s >= 2:
            assert any(start < c < start + s for c in q_cuts), f"piece [{start}, {start + s}) of {p_sizes} not cut"
        start += s
