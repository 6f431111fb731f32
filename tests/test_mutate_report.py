"""tools/mutate.py's score line: a fresh seed from os.urandom when none is given, stated with its time and commit;
the as-run score against the 90 % target, equivalents apart; a given seed or a rescore says it is secondary."""
import io
import types

from tools import mutate


def mutants(killed, survived, equivalent=0, timeout=0):
    out = []
    for outcome, n in (("killed", killed), ("survived", survived), ("equivalent", equivalent),
                       ("timeout", timeout)):
        out += [mutate.Mutant("engine", "attention_core/x.py", "op", i, 1, "a", "b", "", outcome=outcome)
                for i in range(n)]
    return out


def test_without_seed_a_fresh_one_is_drawn_and_dated():
    a = mutate.choose_seed(None, entropy=b"\x00\x01\x02\x03", now=0)
    assert a["fresh"] and a["seed"] == 0x00010203 % 1_000_000 and a["drawn_at"] == "1970-01-01 00:00 UTC"
    assert a["commit"]
    b, c = mutate.choose_seed(None), mutate.choose_seed(None)
    assert b["fresh"] and (b["seed"], c["seed"]) != (13, 13)  # not the old fixed default
    given = mutate.choose_seed(29)
    assert given == {**given, "seed": 29, "fresh": False, "drawn_at": None}


def test_the_headline_is_the_as_run_score_of_a_fresh_seed_against_90_percent():
    meta = {"seed": 66051, "fresh": True, "drawn_at": "2026-12-01 16:00 UTC", "commit": "abc1234"}
    line = mutate.headline("engine", mutants(17, 8, equivalent=2), meta)
    assert "as run: 17 killed / 25" in line and "68.0%" in line and "BELOW the 90% target" in line
    assert "2 equivalent listed separately" in line
    assert "fresh seed 66051, drawn at 2026-12-01 16:00 UTC, after the tests of commit abc1234" in line
    assert "meets the 90% target" in mutate.headline("engine", mutants(18, 1, timeout=1), meta)  # 18/20
    assert "BELOW" in mutate.headline("engine", mutants(17, 1, timeout=1), meta)  # a timeout is no kill


def test_a_given_seed_and_a_rescore_are_marked_secondary():
    given = {"seed": 29, "fresh": False, "commit": "abc1234"}
    assert "NOT a fresh sample" in mutate.headline("engine", mutants(10, 0), given)
    assert "secondary" in mutate.headline("engine", mutants(10, 0), given)
    out = io.StringIO()
    args = types.SimpleNamespace(sample=25)
    meta = {"seed": 5, "fresh": True, "drawn_at": "2026-12-01 16:00 UTC", "commit": "abc1234"}
    mutate.report({"engine": mutants(9, 1)}, {"engine": 100}, {}, args, out=out, meta=meta, rescored=True)
    text = out.getvalue()
    assert "fresh seed 5" in text and "RESCORED" in text and "secondary" in text
