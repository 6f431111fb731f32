"""Calls into the engine's patch from code that interrupts it on the same thread (issue 38 item 1): a real signal
handler (os.kill(SIGUSR1) delivered while the interrupted code is at a given line) and a real sys.settrace function,
fired at every line the counts (attention_core/kernel/counts.py) and the patch's switches and counters
(attention_core/patch.py) run, call stats(), count calls of their own and switch the patch. Nothing waits on its own
thread (each run is under a SIGALRM deadline that turns a deadlock into a failure), every count is exact, and a
switch made inside a switch leaves the patch agreeing with what was asked for last.
Red before: counts.py's lock was a threading.Lock: stats() from a handler interrupting a count waited forever; a
switch inside a _refresh() could leave torch's function ours while the state said off.
"""
import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core import patch
from attention_core.kernel import counts
from line_tracing import line_events
from reentry import Handler, deadline, patch_agrees

TORCH_SDPA = F.scaled_dot_product_attention
FILES = {patch.__file__, counts.__file__}
SECONDS = 30
g = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
REF = TORCH_SDPA(Q, K, V)


@pytest.fixture(autouse=True)
def clean():
    patch.disable()
    patch.reset_stats()
    yield
    patch.disable()
    patch.reset_stats()
    assert F.scaled_dot_product_attention is TORCH_SDPA and patch_agrees(patch, F, TORCH_SDPA) is None


def counted_work():
    """Every count and switch of the patch once: a block routing a call to the engine (entry, the engine's count,
    exit), a block passing a call on (record()), stats()."""
    with ac.patched(force=True, tier="chunked"):
        routed = F.scaled_dot_product_attention(Q, K, V)
    with ac.patched(force=True, min_tokens=10 ** 6):
        passed = F.scaled_dot_product_attention(Q, K, V)
    return routed, passed, patch.stats()


class Reader:
    """What a handler does: read the stats, and (counting=True) make counted calls of its own too."""

    def __init__(self, counting):
        self.counting, self.runs = counting, 0

    def __call__(self):
        self.runs += 1
        if self.counting:
            counts.add(patch.COUNT_PREFIX + "handler")
            patch.record("handler", "passed")
        return patch.stats()


def check_counts(out, reader):
    routed, passed, _ = out
    assert torch.allclose(routed, REF, atol=1e-5) and torch.allclose(passed, REF, atol=1e-6)
    s = patch.stats()
    assert (s["torch_sdpa"]["routed"], s["torch_sdpa"]["passed"]) == (1, 1), s
    if reader.counting:
        assert s["handler"]["routed"] == s["handler"]["passed"] == reader.runs, (s, reader.runs)


@pytest.mark.parametrize("how,counting", [("trace function", True), ("signal handler", True),
                                          ("signal handler", False)])
def test_stats_and_counts_from_inside_every_line_of_a_count_or_switch(how, counting):
    lines = line_events(counted_work, FILES)[1]
    assert lines >= 40, lines
    for at in range(lines):
        patch.reset_stats()
        reader = Reader(counting)
        with deadline(SECONDS, f"a {how} at line event {at}"):
            if how == "trace function":
                out, _ = line_events(counted_work, FILES, at, reader)
            else:
                with Handler(reader) as handler:
                    out, _ = line_events(counted_work, FILES, at, handler.fire)
                assert not handler.errors, handler.errors
        assert reader.runs == 1, (at, reader.runs)
        check_counts(out, reader)


def switches():
    """A sequence of switches of every kind (enable, a new Config, disable keeping blocks, a block's entry and exit),
    each followed by a check that the patch agrees with itself; one call at the end."""
    steps = [lambda: ac.enable(force=True, tier="chunked"),
             lambda: ac.enable(force=True, tier="online", min_tokens=4),
             lambda: patch.disable(close_blocks=False)]
    for step in steps:
        step()
        assert patch_agrees(patch, F, TORCH_SDPA) is None, patch_agrees(patch, F, TORCH_SDPA)
    with ac.patched(force=True, tier="inplace"):
        assert patch_agrees(patch, F, TORCH_SDPA) is None
        out = F.scaled_dot_product_attention(Q, K, V)
    assert patch_agrees(patch, F, TORCH_SDPA) is None
    return [out]


def inner_switch(kind):
    def run():
        if kind == "enable":
            ac.enable(force=True, tier="inplace")
        elif kind == "disable":
            ac.disable()
        elif kind == "disable, blocks kept":
            patch.disable(close_blocks=False)
        else:  # a whole block inside the handler, with a call in it
            with ac.patched(force=True, tier="online"):
                return F.scaled_dot_product_attention(Q, K, V)
        return REF  # no call: the interrupted code's call checks the state left
    return run


@pytest.mark.parametrize("how,kind", [("signal handler", "enable"), ("signal handler", "disable"),
                                      ("trace function", "disable, blocks kept"), ("trace function", "block")])
def test_a_switch_inside_a_switch_at_every_line_leaves_the_patch_agreeing(how, kind):
    """The later switch wins, whatever line of the earlier one it interrupted: after both, the patch is installed
    iff enable() or an open block holds it, torch's function is ours iff installed, the Config in force is the
    latest asked for, and every call (the interrupted code's and the handler's) returns torch's answer."""
    patch.disable()
    lines = line_events(switches, FILES)[1]
    assert lines >= 60, lines
    fired = 0
    for at in range(lines):
        patch.disable()
        action = inner_switch(kind)
        with deadline(SECONDS, f"a {how} switching ({kind}) at line event {at}"):
            if how == "trace function":
                results = []
                out, _ = line_events(switches, FILES, at, lambda: results.append(action()))
            else:
                with Handler(action) as handler:
                    out, _ = line_events(switches, FILES, at, handler.fire)
                assert not handler.errors, (at, handler.errors)
                results = handler.results
        if not results:  # the handler's own switch shortened the run: this line was not reached
            continue
        fired += 1
        assert len(results) == 1, (at, results)
        assert patch_agrees(patch, F, TORCH_SDPA) is None, (at, patch_agrees(patch, F, TORCH_SDPA))
        for o in out + results:
            assert torch.allclose(o, REF, atol=1e-5), at
    assert fired >= lines // 2, (fired, lines)
