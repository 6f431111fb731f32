"""Tests for the survivors of a fresh mutation sample (issue 17 item 10), each shown red with its mutant applied.

They go through public entry points (scaled_dot_product_attention, ops.attention_forward, chunk_ffn, the plan
report, `python -m attention_core.tune`) and measure what a user would notice: an error message, the answer's
shape, the memory a call holds (LiveBytes), the text of a report. The kv-head replication of Ulysses is tested in
test_parallel_kv_copies.py (it needs torch.distributed worker processes).
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from attention_core import TIER_CHOICES, chunk_ffn
from attention_core.cli import plan
from attention_core.kernel import ops
from attention_core.device import profiles
from attention_core import scaled_dot_product_attention as sdpa
from live_bytes import peak_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- autograd.py: the vmap rule refuses a vmapped dropout seed -------------------------------------------------

def test_dropout_under_vmap_with_different_randomness_names_the_seed():
    """vmap(randomness="different") draws one dropout seed per sample; the engine's vmap rule cannot fold those
    into one call and must say so (not fail later on a seed tensor of several elements)."""
    q = torch.randn(3, 1, 2, 8, 4)
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="dropout seed cannot be vmapped"):
        torch.func.vmap(lambda q: sdpa(q, k, v, dropout_p=0.5), randomness="different")(q)
    # a batched mask is no seed: it is folded, with or without dropout (randomness="same": one seed)
    m = torch.randn(3, 1, 1, 8, 8)
    out = torch.func.vmap(lambda q, m: sdpa(q, k, v, attn_mask=m, dropout_p=0.5), randomness="same")(q, m)
    assert out.shape == (3, 1, 2, 8, 4) and torch.isfinite(out).all()


# ---- driver.py: a tuned tile is checked against the budget with every batch x group row ------------------------

def test_a_tuned_tile_over_the_budget_for_all_batch_rows_is_not_taken(profdir, monkeypatch):
    """The profile's tile (2 heads x 32 rows x 256 keys) covers B x G = 16 query rows of each kv head here; at a
    budget that fits it for 8 of them only, the call must plan its own tile: the memory it holds is what it holds
    without the profile (LiveBytes), not the 2x larger tuned tile."""
    B, G, Hkv, L, D = 4, 4, 4, 256, 8
    entry = {"tier": "chunked", "dtype": "float32", "heads": Hkv, "dim": D, "n": L, "rows_timed": L,
             "block_q": 32, "block_kv": L, "heads_per_group": 2, "ms": 1.0, "untuned_ms": 2.0, "use": True}
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "device": "x", "arch": "y",
                           "torch": torch.__version__, "entries": [entry]}, "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hkv * G, L, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    # fp32 chunked tiles on the CPU hold 4 bytes a score (memory.bytes_per_score: P overwrites S); the tuned tile
    # fits the budget for 8 batch x group rows, not for B x G = 16
    budget = 4 * 8 * 32 * L * 2
    with_profile = peak_bytes(ops.attention_forward, q, k, v, enable_gqa=True, memory_budget=budget)
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")
    without = peak_bytes(ops.attention_forward, q, k, v, enable_gqa=True, memory_budget=budget)
    assert with_profile <= 1.1 * without, (with_profile, without)
    # and the answer is torch's
    monkeypatch.delenv(profiles.ENV_SWITCH)
    out, _ = ops.attention_forward(q, k, v, enable_gqa=True, memory_budget=budget)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_tuned_tile_is_taken_exactly_when_it_fits_for_all_batch_rows(profdir, monkeypatch):
    """B = 2, G = 3 (6 query rows of each kv head per tile row, a count no other combination of 2 and 3 gives):
    at a budget of exactly the tuned tile for 6 rows the profile's tile runs; one byte less, the engine's own."""
    from attention_core.kernel import driver
    B, G, Hkv, L, D = 2, 3, 4, 256, 8
    entry = {"tier": "chunked", "dtype": "float32", "heads": Hkv, "dim": D, "n": L, "rows_timed": L,
             "block_q": 32, "block_kv": L, "heads_per_group": 2, "ms": 1.0, "untuned_ms": 2.0, "use": True}
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "device": "x", "arch": "y",
                           "torch": torch.__version__, "entries": [entry]}, "cpu")
    seen = []
    real = driver.TIERS["chunked"]

    def spy(src, block_q, block_kv, need_stats, **kw):
        seen.append((src.p.Hkv, block_q, block_kv))
        return real(src, block_q, block_kv, need_stats, **kw)
    monkeypatch.setitem(driver.TIERS, "chunked", spy)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hkv * G, L, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    exact = 4 * B * G * 32 * L * 2  # 4 bytes a score (fp32 chunked, CPU) x 6 rows x 32 x 256 keys x 2 heads
    ops.attention_forward(q, k, v, enable_gqa=True, memory_budget=exact)
    assert seen == [(2, 32, L), (2, 32, L)]
    seen.clear()
    ops.attention_forward(q, k, v, enable_gqa=True, memory_budget=exact - 1)
    assert seen and (2, 32, L) not in seen


# ---- ffn/: the hidden width and the shape of the pieces' outputs ---------------------------------------------

class Gate(torch.nn.Module):
    """Token-wise, no Linear inside: the hidden width is unknown."""
    def forward(self, x):
        return x * torch.sigmoid(x)


class QuantLinear(torch.nn.Module):
    """A quantised linear layer as loaders make them (not a torch.nn.Linear, but with out_features)."""
    def __init__(self, n_in, n_out):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x):
        return x @ self.weight.t()


def test_a_module_without_linear_has_no_hidden_width_and_auto_chunks_assume_4x(monkeypatch):
    """hidden_features: the widest Linear or linear-like layer (out_features), 0 without one; FFN Chunking's auto
    count then assumes a 4 x width activation."""
    import attention_core.ffn.chunking as chunking
    assert chunking.hidden_features(Gate()) == 0
    assert chunking.hidden_features(torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.GELU(),
                                                        torch.nn.Linear(48, 8))) == 48
    assert chunking.hidden_features(torch.nn.Sequential(QuantLinear(8, 96), torch.nn.GELU(),
                                                        torch.nn.Linear(96, 8))) == 96
    monkeypatch.setattr(chunking, "free_memory", lambda device: 1 << 20)
    w = chunk_ffn(Gate(), chunks=0)
    assert w.hidden == 0
    x = torch.empty(2, 1000, 24)
    # 2 (pre- and post-activation) x 2000 tokens x 96 hidden x 4 bytes against a quarter of 1 MiB
    expected = math.ceil(2 * 2 * 1000 * 4 * 24 * 4 / ((1 << 20) * chunking.AUTO_SHARE))
    assert w.chunk_count(x) == expected == 6


class OneRow(torch.nn.Module):
    """Ignores the tokens' values and returns one row: identical for every piece, so both partitions agree."""
    def __init__(self):
        super().__init__()
        self.row = torch.nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, x):
        return self.row.expand(x.shape[0], 1, x.shape[-1])


class PerTokenScore(torch.nn.Module):
    """Token-wise, but drops the feature axis: [B, N, C] -> [B, N]."""
    def forward(self, x):
        return x.square().sum(-1)


class PerTokenPair(torch.nn.Module):
    """Token-wise, but adds an axis: [B, N, C] -> [B, N, C, 2]."""
    def forward(self, x):
        return torch.stack([x, -x], dim=-1)


def test_outputs_without_a_row_per_token_run_unchunked():
    """A piece's output must be one tensor of the input's rank with one row per token of the piece; anything
    else runs as the plain module (same answer, same shape), never stitched together from pieces."""
    x = torch.randn(2, 12, 8)
    for module in (OneRow(), PerTokenScore(), PerTokenPair()):
        with torch.no_grad():
            ref = module(x)
            w = chunk_ffn(module, chunks=3)
            out = module(x)
        assert out.shape == ref.shape and torch.equal(out, ref), type(module).__name__
        assert w.calls_chunked == 0 and w.verified is False, type(module).__name__


class Register(torch.nn.Module):
    """Token-wise until `append` is set (same input shape, so the same verdict); then it adds a register token."""
    def __init__(self):
        super().__init__()
        self.append = False

    def forward(self, x):
        y = x * 2
        return torch.cat([y, y[:, :1] * 0], dim=1) if self.append else y


def test_a_module_that_starts_returning_more_tokens_after_the_check_runs_whole():
    """A checked signature whose pieces later come back with more rows than they had tokens: the plain call is
    the answer (not an error from stitching the pieces)."""
    module = Register()
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        w = chunk_ffn(module, chunks=3)
        assert torch.equal(module(x), x * 2) and w.calls_chunked == 1
        module.append = True
        out = module(x)
    assert out.shape == (2, 13, 8) and torch.equal(out[:, :12], x * 2) and w.calls_chunked == 1


def test_pieces_longer_than_256_tokens_are_chunked_exactly():
    """Piece lengths are compared by value (CPython caches only small ints: an identity test would reject every
    piece past 256 tokens and silently never chunk)."""
    torch.manual_seed(5)
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(1, 1200, 8)
    with torch.no_grad():
        ref = module(x)
        w = chunk_ffn(module, chunks=2)
        out = module(x)
    assert w.verified and w.calls_chunked == 1
    assert torch.allclose(out, ref, atol=1e-6)


# ---- ops.py: empty problems ------------------------------------------------------------------------------------

EMPTY = {  # (q, k/v) shapes [B, H, L, E]; every one has a zero somewhere
    "batch": ((0, 2, 5, 4), (0, 2, 6, 4)),
    "heads": ((1, 0, 5, 4), (1, 0, 6, 4)),
    "query_heads_gqa": ((1, 0, 5, 4), (1, 2, 6, 4)),
    "queries": ((1, 2, 0, 4), (1, 2, 6, 4)),
    "keys": ((1, 2, 5, 4), (1, 2, 0, 4)),
}


@pytest.mark.parametrize("tier", TIER_CHOICES)
@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_problems_give_torchs_answer_and_gradients(case, tier):
    """Forward and backward of a problem with an empty dimension equal torch's math SDPA on float64 copies (no
    keys: torch gives NaN rows; the engine's documented answer is zeros, so that case checks the shape and zero
    gradients)."""
    qs, ks = EMPTY[case]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True) for s in (qs, ks, ks))
    gqa = qs[1] != ks[1]
    out = sdpa(q, k, v, enable_gqa=gqa, tier=tier)
    (out * 1.5).sum().backward()
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, enable_gqa=gqa)
    (ref * 1.5).sum().backward()
    assert out.shape == ref.shape
    if case == "keys":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert torch.equal(out, ref)
    for mine, theirs in zip((q, k, v), leaves):
        assert mine.grad is not None and mine.grad.shape == theirs.shape
        assert torch.equal(mine.grad, torch.zeros_like(mine.grad)), case


# ---- plan.py: "without the pack: math SDPA needs ..." only when it does not fit ----------------------------------

def test_the_plan_says_math_does_not_fit_exactly_when_it_needs_more_than_is_free():
    est = plan.estimate("wan22-5b", 832, 480, 41, free=1 << 40, dtype_bytes=2)
    need = est["math"]
    fits = plan.report(plan.estimate("wan22-5b", 832, 480, 41, free=need, dtype_bytes=2))
    short = plan.report(plan.estimate("wan22-5b", 832, 480, 41, free=need - 1, dtype_bytes=2))
    ample = plan.report(plan.estimate("wan22-5b", 832, 480, 41, free=2 * need, dtype_bytes=2))
    for text in (fits, ample):
        math_line = [ln for ln in text.splitlines() if "torch math SDPA" in ln]
        assert math_line and "DOES NOT FIT" not in math_line[0]
        assert "without the pack" not in text
    assert [ln for ln in short.splitlines() if "torch math SDPA" in ln and "DOES NOT FIT" in ln]
    assert "without the pack: math SDPA needs" in short


# ---- tune.py: the command line --------------------------------------------------------------------------------

TINY_SHAPE = ["--presets", "reference", "--max-n", "512", "--rows", "64", "--repeats", "1"]
TINY = TINY_SHAPE + ["--dtype", "float32", "--device", "cpu"]


def _check_tiny_profile(path, dtype="float32"):
    import json
    with open(path) as f:
        prof = json.load(f)
    (e,) = prof["entries"]  # the reference preset's 3 lengths all capped to 512: one shape
    assert (e["tier"], e["dtype"], e["heads"], e["n"], e["dim"]) == ("chunked", dtype, 16, 512, 64)
    assert e["block_kv"] == 512 and 16 % e["heads_per_group"] == 0 and e["rows_timed"] == 64


def test_tune_main_tunes_the_presets_capped_to_max_n_and_saves_the_profile(tmp_path, capsys):
    """Defaults: the accelerator if any (else the CPU), float16 there, float32 on the CPU."""
    from attention_core.cli import tune
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = tmp_path / "p.json"
    assert tune.main(TINY_SHAPE + ["--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"tuning {device}" in text and "[(16, 512, 64)]" in text and f"saved {out}" in text
    _check_tiny_profile(out, "float32" if device == "cpu" else "float16")


def test_tune_command_line_writes_the_profile_the_planner_reads(tmp_path):
    """`python -m attention_core.tune` as a user runs it: the profile lands in $TILED_ATTENTION_PROFILE_DIR under
    this device's name, and tuned_blocks reads it."""
    env = {**os.environ, profiles.ENV_DIR: str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop(profiles.ENV_SWITCH, None)
    # --force-busy: the load guard has its own tests; a busy CI machine must not fail this one
    proc = subprocess.run([sys.executable, "-m", "attention_core.tune", *TINY, "--force-busy"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    assert f"saved {path}" in proc.stdout
    _check_tiny_profile(path)


# ---- the survivors of the engine draw of seed 131469 (issue 22.11) ----------------------------------------------

def test_the_exactness_check_matches_infinities_of_either_sign_and_nans():
    """ffn.exactness._close: the same +inf, -inf and nan in the same places are the same answer (non-finite
    values compare by kind), a different kind or place is not."""
    from attention_core.ffn.exactness import _close
    a = torch.tensor([1.0, float("inf"), float("-inf"), float("nan"), 2.0])
    assert _close(a, a.clone())
    for i, other in ((1, float("-inf")), (2, float("inf")), (3, float("inf")), (1, float("nan"))):
        b = a.clone()
        b[i] = other
        assert not _close(a, b), (i, other)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_run_pieces_concatenates_along_any_token_axis(dim):
    """ffn.chunking.run_pieces puts uneven pieces (4, 4, 2 tokens) back along the token axis, wherever it is; an
    output whose other axes change from piece to piece cannot be chunked (None)."""
    from attention_core.ffn.chunking import run_pieces
    shape = [3, 5, 6]
    shape[dim] = 10
    x = torch.randn(*shape, 2)
    torch.testing.assert_close(run_pieces(lambda t: t * 2, x, [4, 4, 2], dim, (), {}), x * 2, rtol=0, atol=0)
    grows = iter(range(1, 10))

    def ragged(t):  # the last axis (not the token axis) changes between pieces
        return t[..., :1].expand(*t.shape[:-1], next(grows))
    assert run_pieces(ragged, x, [4, 4, 2], dim, (), {}) is None


def test_attention_forward_of_2d_inputs_returns_2d_out_and_1d_lse():
    """ops.attention_forward on unbatched [L, E] inputs (as torch's SDPA takes them) returns out [L, Ev] and the
    log-sum-exp [L], equal to torch's on the same inputs."""
    torch.manual_seed(3)
    q, k, v = torch.randn(6, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64), \
        torch.randn(9, 5, dtype=torch.float64)
    out, lse = ops.attention_forward(q, k, v)
    assert out.shape == (6, 5) and lse.shape == (6,)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q[None], k[None], v[None])[0])
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.T / math.sqrt(8), dim=-1))


def test_fp16_backward_takes_fp32_when_dq_partial_sums_could_overflow():
    """backward_dtype: half-precision backward GEMMs only while every partial sum stays inside fp16's range; the
    dQ bound is 2 * max|dP row| * keys * max|k| * scale. One query row of tiny q against 1,024 keys with |k| = 10,
    |dO| = |v| = sqrt(10) per row, scale 0.5: dQ's bound 2 * 10 * 1024 * 10 * 0.5 = 102,400 passes fp16's safe
    range (every other bound is far inside), so fp32; with 16 keys (1,600) fp16."""
    from attention_core.kernel.numerics import FP16_SAFE, choose_numerics
    from attention_core.kernel.problem import normalize
    from attention_core.kernel.tiers.backward import backward_dtype
    from attention_core.kernel.tiles import TileSource

    def dtype_for(keys):
        q = torch.full((1, 1, 1, 4), 1e-3, dtype=torch.float16)
        k = torch.full((1, 1, keys, 4), 5.0, dtype=torch.float16)  # row norm 10
        v = torch.full((1, 1, keys, 4), 10 ** 0.5 / 2, dtype=torch.float16)  # row norm sqrt(10)
        dout = torch.full((1, 1, 1, 4), 10 ** 0.5 / 2, dtype=torch.float16)
        p = normalize(q, k, v, None, 0.0, False, 0.5)
        src = TileSource(p, choose_numerics(p.dtype, p.device, precision="input"))
        return backward_dtype(src, dout, 1, keys)
    assert 2 * 10 * 16 * 10 * 0.5 < FP16_SAFE < 2 * 10 * 1024 * 10 * 0.5
    assert dtype_for(16) == torch.float16
    assert dtype_for(1024) == torch.float32


# ---- the survivors of the engine draw of seed 483127 (issue 22.11) ----------------------------------------------

def test_profiles_and_calibrations_are_written_readable_by_everyone(tmp_path):
    """jsonfile.atomic_write_json leaves the file rw-r--r-- (0o644): mkstemp's private 0o600 is widened, no more."""
    import stat
    from attention_core.device import jsonfile
    path = jsonfile.atomic_write_json(str(tmp_path / "p.json"), {"a": 1})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_dropout_without_a_seed_is_refused_and_no_dropout_needs_none():
    """ops._seed: dropout_p > 0 without dropout_seed is refused (the backward could not recompute the keep bits);
    without dropout the seed is 0, with one it is kept."""
    with pytest.raises(ValueError, match="need dropout_seed"):
        ops._seed(0.5, None)
    assert ops._seed(0.0, None) == 0 and ops._seed(0.5, 7) == 7 and ops._seed(0.0, 3) == 3


def test_min_tokens_of_one_keeps_empty_sequences_for_torch():
    """patch._long_enough: min_tokens 0 (or less) routes every call; from 1 up, the longer of the two sequences
    must have at least min_tokens tokens, so empty sequences stay with torch at min_tokens 1."""
    from attention_core import patch
    empty, three = torch.empty(1, 1, 0, 4), torch.empty(1, 1, 3, 4)
    assert patch._long_enough(empty, empty, 0) and patch._long_enough(empty, empty, -5)
    assert not patch._long_enough(empty, empty, 1)
    assert patch._long_enough(three, empty, 3) and not patch._long_enough(three, three, 4)


def test_tune_keeps_the_smallest_tile_by_its_scores_across_head_counts():
    """tune.choose: among tiles within the tolerance of the fastest, the fewest scores (rows x keys x heads): 64
    rows x 1,024 keys x 4 heads (262,144) before 512 x 1,024 x 1 (524,288), equally fast; a slower one outside the
    tolerance loses whatever its size."""
    from attention_core.cli import tune
    small, tall = (64, 1024, 4), (512, 1024, 1)
    assert tune.choose([(tall, 1.0), (small, 1.0)]) == (small, 1.0)
    assert tune.choose([(tall, 1.0), (small, 2.0)]) == (tall, 1.0)


def test_forward_mode_is_possible_inside_any_dual_level_and_not_outside():
    """tangents.forward_mode_possible: False with no forward-AD level open and no jvp transform; True inside the
    first dual level (level 0), a nested one, and under torch.func.jvp (what makes torch.compile trace the call as
    plain ops)."""
    import torch.autograd.forward_ad as fwAD
    from attention_core.kernel.tangents import forward_mode_possible
    assert fwAD._current_level == -1 and not forward_mode_possible()
    with fwAD.dual_level():
        assert fwAD._current_level == 0 and forward_mode_possible()
    assert not forward_mode_possible()
    seen = []

    def f(x):
        seen.append(forward_mode_possible())
        return x * 2
    torch.func.jvp(f, (torch.ones(2),), (torch.ones(2),))
    assert seen == [True]


# ---- the survivors of the engine draw of seed 880496 (issue 22.11) ----------------------------------------------

def test_the_finite_abs_max_counts_negative_values():
    """tiles._finite_abs_max: max |t| over the finite elements, a negative minimum included (it decides the V
    scaling that keeps fp32 sums finite)."""
    from attention_core.kernel.tiles import _finite_abs_max
    assert _finite_abs_max(torch.tensor([-5.0, 1.0, 2.0])) == 5.0
    assert _finite_abs_max(torch.tensor([-1.0, 3.0])) == 3.0
    assert _finite_abs_max(torch.tensor([-7.0, float("inf"), 2.0])) == 7.0


@pytest.mark.parametrize("keys_major", [False, True])
def test_tunes_layout_loop_covers_every_head(keys_major):
    """tune._chunked_loop (the loop the layout check times) computes attention for every head of the group: with 3
    heads and uneven query tiles it equals torch's SDPA (with q pre-scaled, as the engine hands it), in scratch
    buffers sized for every head (an undersized one is resized by torch with a warning: another allocation per tile,
    which would skew the timing)."""
    from attention_core.cli import tune
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 3, n, 8, generator=g, dtype=torch.float64) for n in (10, 12, 12))
    import warnings
    with warnings.catch_warnings():  # the scratch buffers hold every head's tile: nothing resized on the way
        warnings.simplefilter("error")
        got = tune._chunked_loop(q / math.sqrt(8), k, v, 4, keys_major)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v))


# ---- ffn/signature.py: only an argument with exactly n tokens is per-token ------------------------------------

def test_a_longer_context_argument_does_not_stop_ffn_chunking():
    """A block whose forward takes a context longer than x along the token axis (cross-attention text tokens)
    hands that context whole to every piece: it is no per-token argument, and the call is still chunked (pieces
    of n / 4 tokens), exactly. Only an extra tensor with exactly n entries there would not line up."""
    lin = torch.nn.Linear(8, 8)

    class WithContext(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.seen = lin, []

        def forward(self, x, context):
            self.seen.append(x.shape[1])
            return self.lin(x) + context.mean(dim=1, keepdim=True)

    m = WithContext()
    x, ctx = torch.randn(1, 32, 8), torch.randn(1, 48, 8)  # 48 context tokens > 32 tokens of x
    want = lin(x) + ctx.mean(dim=1, keepdim=True)
    chunk_ffn(m, chunks=4)
    m.seen.clear()
    got = m(x, ctx)
    assert torch.allclose(got, want, atol=1e-6)
    assert m.seen[-4:] == [8, 8, 8, 8], m.seen  # the real call ran in 4 pieces, not whole


# ---- kernel/memory.py: CUDA free memory is the driver's free plus the cache's unused blocks ---------------------

def test_cuda_free_memory_adds_the_cached_but_unused_blocks(monkeypatch):
    """What the tiles may take on a GPU: the driver's free bytes plus what PyTorch's caching allocator holds
    reserved but not allocated (it hands those out without asking the driver). The CUDA queries are stand-ins
    (no GPU here); the sum is what the engine's tile sizing reads."""
    from attention_core.kernel import memory
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (3 * gib, 32 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 7 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 4 * gib)
    assert memory.free_memory(torch.device("cuda", 0)) == 6 * gib  # 3 free + (7 - 4) cached
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 8 * gib)  # never negative
    assert memory.free_memory(torch.device("cuda", 0)) == 3 * gib


# ---- report.py: only a CUDA / ROCm device gets the GPU rows ------------------------------------------------------

def test_report_device_section_for_a_device_that_is_not_cuda_has_no_gpu_rows():
    """`report --device xpu` (an Intel GPU) or any type other than cuda must not be asked CUDA's device properties:
    its section is the generic one (the host's memory), written without an error cell."""
    from attention_core.cli import report
    ctx = {}
    text = report.section_device("xpu", ctx)
    assert "compute units" not in text and "Error" not in text and "| memory total |" in text, text


# ---- the survivors of the engine draw of seed 306694 (issue 22.11) ----------------------------------------------

def test_rates_interpolate_log_log_between_points_further_apart_than_a_square():
    """A calibration may hold token counts far apart (a hand-edited file, GEMM rows of 8 and 4,096): between 10 and
    1,000 tokens, 200 is t = log(20) / log(100) of the way in log space, rate 1 * 100^t = 20 GFLOP/s (log-log), for
    any distance between the points."""
    from attention_core.cli import estimate
    rows = [{"tokens": 10, "gflops": 1.0}, {"tokens": 1000, "gflops": 100.0}]
    assert estimate._interp(rows, 200) == pytest.approx(20.0, rel=1e-12)
    assert estimate._interp(rows, 100) == pytest.approx(10.0, rel=1e-12)


def test_a_two_dimensional_input_is_chunked_along_its_token_axis():
    """x of (tokens, features) with dim=0 (a module fed unbatched tokens) is chunked along its rows: 4 pieces of 8,
    the same answer; only dim=1 (the feature axis) runs plain."""
    lin = torch.nn.Linear(8, 8)

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.seen = lin, []

        def forward(self, x):
            self.seen.append(tuple(x.shape))
            return self.lin(x)

    m = Rows()
    x = torch.randn(32, 8)
    want = lin(x)
    chunk_ffn(m, chunks=4, dim=0)
    m.seen.clear()
    assert torch.allclose(m(x), want, atol=1e-6)
    assert m.seen[-4:] == [(8, 8)] * 4, m.seen


def test_dropout_one_has_zero_gradients():
    """dropout_p = 1 drops every weight: O = 0 whatever q, k, v are, so their gradients are exactly zero (torch's
    math SDPA gives the same), not a division by 1 - p = 0 in the backward."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(3))
    out = sdpa(q, k, v, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t)), t.grad


def test_the_fp16_weights_times_v_guard_starts_at_the_safe_bound():
    """pv_needs_fp32(keys) is the bound keys * max|v| >= FP16_SAFE (32,752): with max|v| = 4, 8,188 keys reach it
    exactly and need fp32, 8,187 do not."""
    from attention_core.kernel.numerics import FP16_SAFE, choose_numerics
    from attention_core.kernel.problem import normalize
    from attention_core.kernel.tiles import TileSource
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    v = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    v[0, 0, 0, 0] = -4.0
    p = normalize(q, q, v)
    src = TileSource(p, choose_numerics(p.dtype, p.device, precision="input"))
    assert src.guard and 8188 * 4.0 == FP16_SAFE
    assert src.pv_needs_fp32(8188) and not src.pv_needs_fp32(8187)


def test_row_norm_max_of_an_empty_tensor_is_zero():
    """No rows bound nothing: 0 (a head dim of 0 gives q of no elements; its scores are all 0)."""
    from attention_core.kernel.numerics import row_norm_max
    assert row_norm_max(torch.empty(2, 0, 8)) == 0.0 and row_norm_max(torch.empty(3, 0)) == 0.0
    assert row_norm_max(torch.tensor([[3.0, -4.0], [1.0, 0.0]])) == 5.0


def test_every_gpu_self_check_case_is_a_valid_attention_problem():
    """The self-check's GPU cases (half precision, the fp16 overflow case) cannot run here, but each must be a
    problem torch's SDPA accepts: run every case built for a GPU through the engine and math SDPA in fp32 on the
    CPU and compare with float64 math, within a few times torch's own fp32 error."""
    from attention_core.cli import selfcheck
    names = []
    for name, _, q, k, v, kw in selfcheck.cases(torch.device("cuda")):
        names.append(name)
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
        torch_err = float((F.scaled_dot_product_attention(q, k, v, **kw).double() - want).abs().max())
        got = sdpa(q, k, v, **kw)
        assert float((got.double() - want).abs().max()) <= 4 * torch_err + 1e-6, name
    assert "fp16 overflowing scores" in names


def test_the_report_prints_its_progress_flushed(monkeypatch, tmp_path):
    """python -m attention_core.report prints each progress line flushed (a piped log shows it as it happens),
    seed 24328's survivor: the log callback it gives build() calls print(..., flush=True)."""
    from attention_core.cli import report
    printed = []
    monkeypatch.setattr(report, "print", lambda *a, **kw: printed.append(kw.get("flush")), raising=False)
    monkeypatch.setattr(report, "build", lambda device, quick, comfyui, log: (log("step"), "text")[1])
    report.main(["--out", str(tmp_path / "r.md")])
    assert printed and printed[0] is True, printed


def test_key_and_value_with_fewer_batch_dims_broadcast_as_torch():
    """q with two batch dims, k and v with one (torch's SDPA broadcasts them as matmul does): the engine reads each
    tensor's batch sizes from its own end, the same answer as torch's. Fresh draw 24328's survivor (the offset
    nd - dim as nd >> dim), written after the draw."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 2, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    ref = torch._C._nn.scaled_dot_product_attention(q, k, v)
    for tier in ("chunked", "online", "inplace"):
        assert torch.allclose(sdpa(q, k, v, tier=tier), ref, atol=1e-12), tier
