"""tools/mutation/mutate.py's score line: a fresh seed from os.urandom when none is given, stated with its time and
commit; the as-run score against the 90 % target, equivalents apart; a given seed or a rescore says it is secondary."""
import io
import types

from tools.mutation import mutate


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


# ---- issue 22: keyed equivalents, the sample before the coverage run, partial reports, the draws log, nodes/

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = mutate.ROOT


def located(path, line, after, root=ROOT):
    """A mutant of `path` at `line` whose mutated line is `after`, located as the tool locates it."""
    source = (root / path).read_text(encoding="utf-8")
    before = source.split("\n")[line - 1]
    m = mutate.Mutant("engine", path, "op", 0, line, before, after, "diff")
    m.scope, m.nth = mutate.locate(source, line)
    return m


def line_of(path, text, nth=1):
    lines = (ROOT / path).read_text(encoding="utf-8").split("\n")
    return [i for i, ln in enumerate(lines, 1) if ln.strip() == text][nth - 1]


def test_every_equivalent_entry_names_a_line_that_exists():
    """An entry whose line is gone or changed (or whose function was renamed) is stale: the mutant it excused
    must be examined again. `./dev mutate --check-equivalents` names them; this test fails on any."""
    assert mutate.stale_equivalents() == []


def test_an_equivalent_entry_covers_only_the_line_it_names():
    """estimate._interp has `return pts[-1][1]` twice: the second (after the loop) is unreachable, the first (n at
    or above the last measured count) is not. Keyed by place, only the second is excused."""
    path, text = "attention_core/cli/estimate.py", "return pts[-1][1]"
    first, second = line_of(path, text, 1), line_of(path, text, 2)
    for after in ("        return pts[~1][1]", "        return pts[-2][1]"):
        assert mutate.equivalent_reason(located(path, second, after))
        assert mutate.equivalent_reason(located(path, first, after)) is None
    # the same text in two functions: each is its own entry (ops.py's empty-problem guard, forward and backward)
    line = "if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:"
    mutated = "    " + line.replace("p.B == 0", "p.B <= 0")
    ops = "attention_core/kernel/ops.py"
    fwd, bwd = (located(ops, line_of(ops, line, i), mutated) for i in (1, 2))
    assert (fwd.scope, bwd.scope) == ("forward_canonical", "backward_canonical")
    assert mutate.equivalent_reason(fwd) and mutate.equivalent_reason(bwd)


def test_the_head_group_mutants_of_ulysses_are_listed_equivalent_as_no_zero_heads_reach_them():
    """`g = H // Hkv` as /, %, *, ** or <<: since issue 22.8 zero heads return before this line and zero kv heads
    are refused by the agreement (test_parallel.py's zero-heads test), so g's every mutant here is a multiple of the
    kv-copy count whenever // is, and they are listed equivalent; + and - are not."""
    path = "attention_core/parallel/ulysses.py"
    line = line_of(path, "g = H // Hkv")
    for op in ("/", "%", "*", "**", "<<"):
        assert mutate.equivalent_reason(located(path, line, f"    g = H {op} Hkv"))
    for op in ("+", "-"):
        assert mutate.equivalent_reason(located(path, line, f"    g = H {op} Hkv")) is None


def test_stale_entries_are_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/a.py").write_text("X = 1\n\n\nclass K:\n    def f(self):\n        return X\n\n\n"
                                       "def g():\n    return X\n", encoding="utf-8")
    entries = [("pkg/a.py::K.f", "return X", "return -X", "ok"),
               ("pkg/a.py::g", "return X", "return -X", "ok"),
               ("pkg/a.py::<module>", "X = 1", "X = 2", "ok"),
               ("pkg/a.py::K.f#2", "return X", "return -X", "only one such line"),
               ("pkg/a.py::f", "return X", "return -X", "renamed scope"),
               ("pkg/a.py::g", "return Y", "return -Y", "changed line"),
               ("pkg/b.py::g", "return X", "return -X", "missing file"),
               ("pkg/a.py:g", "return X", "return -X", "malformed key"),
               ("pkg/a.py::g", "return X", "return X", "not a mutant"),
               ("pkg/a.py::g", "return X", "return -X", "twice")]
    stale = mutate.stale_equivalents(tmp_path, entries)
    assert len(stale) == 7, stale
    assert "only 1 such line(s) in K.f" in stale[0] and "no such line in f of pkg/a.py" in stale[1]
    assert "no such line in g" in stale[2] and "pkg/b.py does not exist" in stale[3]
    assert "must read" in stale[4] and "the mutated line is the original" in stale[5] and "listed twice" in stale[6]
    monkeypatch.setattr(mutate, "EQUIVALENT", entries[:3])
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    assert mutate.main(["--check-equivalents"]) == 0
    assert "3 entries, each names a line that exists" in capsys.readouterr().out
    monkeypatch.setattr(mutate, "EQUIVALENT", entries[:5])
    assert mutate.main(["--check-equivalents"]) == 1
    out = capsys.readouterr().out
    assert "2 stale EQUIVALENT entries" in out and "pkg/a.py::f `return X` -> `return -X`" in out


def test_nodes_mutates_every_file_of_nodes_each_with_its_tests():
    files = mutate.module_files("nodes", ROOT)
    assert files == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "nodes").glob("*.py"))
    for f in files:
        entry = next(t for prefix, t in mutate.BY_FILE if f.startswith(prefix))  # its own selection
        assert entry and set(mutate.tests_for("nodes", f, ROOT)) == {t for t in entry if (ROOT / t).exists()}
    assert mutate.build_parser().parse_args(["--module", "adapter"]).module == "adapter"
    assert mutate.ALIASES["adapter"] == "nodes"
    assert mutate.build_parser().parse_args([]).sample == 40


def test_every_test_file_a_selection_names_exists():
    """A selection naming a test file that is gone would silently run less (the tool drops missing files for
    --ref trees of other revisions)."""
    named = {t for _, tests in mutate.BY_FILE for t in tests} | set(mutate.NODE_TESTS) | set(mutate.NEW_KILL_TESTS)
    assert sorted(t for t in named if not (ROOT / t).is_file()) == []


def fake_run(monkeypatch, tmp_path, crash_at=None):
    """main() on the real tree without running a test: the coverage run and the mutant runs are recorded."""
    seen = {"baseline": [], "runs": 0}

    def baseline(tree, module, tests, timeout, deselect=()):
        seen["baseline"].append((module, list(tests)))
        every_line = {ln: {"engine/test_x.py::test_x"} for ln in range(1, 5000)}  # as if one test ran them all
        return [], {f: every_line for f in mutate.module_files(module, tree)}, 1.0

    def run_mutant(tree, m, cmd, timeout):
        seen["runs"] += 1
        if seen["runs"] == crash_at:
            raise RuntimeError("boom")
        m.outcome = "killed" if seen["runs"] % 2 else "survived"
        return m

    monkeypatch.setattr(mutate, "copy_tree", lambda dest, ref=None: ROOT)  # nothing is mutated: read only
    monkeypatch.setattr(mutate, "baseline", baseline)
    monkeypatch.setattr(mutate, "run_mutant", run_mutant)
    monkeypatch.setattr(mutate, "DRAWS_LOG", tmp_path / "draws.jsonl")
    return seen


def test_the_coverage_run_covers_only_the_sampled_files_and_the_draw_is_logged(monkeypatch, tmp_path, capsys):
    seen = fake_run(monkeypatch, tmp_path)
    js, md = tmp_path / "run.json", tmp_path / "run.md"
    assert mutate.main(["--module", "nodes", "--file", "fit.py", "--sample", "3", "--json", str(js),
                        "--report", str(md)]) == 0
    assert seen["baseline"] == [("nodes", sorted(mutate.tests_for("nodes", "nodes/fit.py", ROOT),
                                                 key=lambda t: (t in mutate.NEW_KILL_TESTS, t)))]
    data = json.loads(js.read_text())
    assert data["_meta"]["complete"] is True and len(data["nodes"]) == 3
    [entry] = mutate.read_draws(tmp_path / "draws.jsonl")
    assert entry["module"] == "nodes" and entry["seed"] == data["_meta"]["seed"] and entry["complete"]
    assert entry["sampled"] == 3 and entry["killed"] + entry["survived"] + entry["equivalent"] \
        + entry["incompetent"] == 3
    assert entry["filters"] == {"file": ["fit.py"]} and not entry["whole_module"]
    # a repeat of a seed is not a draw: nothing logged
    assert mutate.main(["--module", "nodes", "--file", "fit.py", "--sample", "3", "--seed", "5", "--json",
                        str(js), "--report", str(md)]) == 0
    assert len(mutate.read_draws(tmp_path / "draws.jsonl")) == 1


def test_a_run_that_stops_leaves_a_partial_report_and_is_logged(monkeypatch, tmp_path, capsys):
    """After every mutant the JSON and the report are rewritten: a crash (or a kill) leaves what was run, with
    the rest pending, which --rescore reads; the draw is logged as incomplete."""
    fake_run(monkeypatch, tmp_path, crash_at=2)
    js, md = tmp_path / "run.json", tmp_path / "run.md"
    with pytest.raises(RuntimeError, match="boom"):
        mutate.main(["--module", "engine", "--file", "plan.py", "--operator", "Comparison", "--sample", "6",
                     "--json", str(js), "--report", str(md)])
    data = json.loads(js.read_text())
    outcomes = [m["outcome"] for m in data["engine"]]
    assert data["_meta"]["complete"] is False and "boom" in data["_meta"]["stopped"]
    assert outcomes.count("killed") == 1 and "pending" in outcomes
    assert "Partial report" in md.read_text() and "INCOMPLETE" in md.read_text()
    [entry] = mutate.read_draws(tmp_path / "draws.jsonl")
    assert entry["complete"] is False and entry["killed"] == 1 and entry["pending"] == outcomes.count("pending")
    capsys.readouterr()
    assert mutate.main(["--rescore", str(js)]) == 0
    assert "INCOMPLETE" in capsys.readouterr().out


def test_the_readme_states_the_latest_draw_of_each_module_not_the_best():
    """docs/development.md's figure per module is its latest whole-module draw in docs/mutation-draws.jsonl, word for word
    (mutate.readme_figure), whatever it scored; a module never drawn says so."""
    draws = mutate.read_draws()
    readme = " ".join((ROOT / "docs" / "development.md").read_text(encoding="utf-8").split())
    for module in mutate.MODULES:
        figure = mutate.readme_figure(module, mutate.latest_draw(draws, module))
        assert figure in readme, f"docs/development.md must state: {figure}"


def test_the_latest_draw_is_the_last_whole_module_one_whatever_it_scored():
    log = [{"module": "engine", "whole_module": True, "killed": 24, "survived": 1, "timeout": 0, "equivalent": 0,
            "sampled": 25, "score": 96.0, "seed": 1, "complete": True, "pending": 0},
           {"module": "adapter", "whole_module": True, "killed": 9, "survived": 1, "timeout": 0, "equivalent": 0,
            "sampled": 10, "score": 90.0, "seed": 2, "complete": True, "pending": 0},
           {"module": "engine", "whole_module": True, "killed": 15, "survived": 5, "timeout": 0, "equivalent": 0,
            "sampled": 20, "score": 75.0, "seed": 3, "complete": False, "pending": 2, "drawn_at": "D",
            "commit": "abc"},
           {"module": "engine", "whole_module": False, "killed": 3, "survived": 0, "timeout": 0, "equivalent": 0,
            "sampled": 3, "score": 100.0, "seed": 4, "complete": True, "pending": 0}]
    assert mutate.latest_draw(log, "engine")["seed"] == 3 and mutate.latest_draw(log, "nodes")["seed"] == 2
    assert mutate.readme_figure("engine", mutate.latest_draw(log, "engine")) == (
        "engine: 15 killed / 20 = 75.0 % as run (5 survived, 0 timeout, 0 equivalent; 20 sampled, INCOMPLETE: 2 "
        "not run; fresh seed 3, drawn D at commit abc)")
    assert mutate.readme_figure("nodes", None) == "nodes: no fresh draw logged yet"


def test_a_line_run_at_import_is_covered_by_every_test_of_its_file():
    """Module and class statements, decorators and def headers run when the module is imported, credited by
    coverage to whichever test imported it first: a mutant there runs every test that runs any line of the file
    (a decorator removed from a property survived a draw on the one test that happened to import the module)."""
    source = ("import os\nLIMIT = 40\n\n\nclass A:\n    size = 3\n\n    @property\n    def n(self):\n"
              "        return LIMIT\n\n\ndef f(x=LIMIT):\n    return x + 1\n")
    assert mutate.import_time_lines(source) >= {1, 2, 5, 6, 8, 9, 13}
    assert not mutate.import_time_lines(source) & {10, 14}
    lines = {"nodes/x.py": {2: {"t.py::imports_first"}, 10: {"t.py::reads_n"}, 14: {"u.py::calls_f"}}}

    def at(line):
        return mutate.Mutant("nodes", "nodes/x.py", "op", 0, line, "a", "b", "")
    timed = mutate.import_time_lines(source)
    assert mutate.covering_tests(at(2), lines, (), timed) == ["t.py::imports_first", "t.py::reads_n", "u.py::calls_f"]
    assert mutate.covering_tests(at(10), lines, (), timed) == ["t.py::reads_n"]  # a body line: its own tests
    assert mutate.covering_tests(at(2), lines) == ["t.py::imports_first"]  # without the rule: the importer alone
