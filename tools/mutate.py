"""Mutation testing of the engine (attention_core/) and the ComfyUI adapter (nodes/comfy_adapter.py).

    ./dev mutate                                   both modules, 40 mutants each, a FRESH seed (printed)
    ./dev mutate --module engine --sample 0        every engine mutant (hours on 2 cores)
    ./dev mutate --module adapter --sample 20 --seed 3 --timeout 300
    ./dev mutate --module engine --file tiles.py --operator Comparison
    ./dev mutate --ref main                        mutate the tree of another revision (with its own tests)
    ./dev mutate --list                            count the mutants per file, run nothing

Cosmic Ray (cosmic-ray on PyPI, pinned in tests/requirements-test.txt) makes the mutants with its core operators
and applies each one: it writes the mutated module to disk, the tests run, the file is put back. Here that
happens in a COPY of the tree (tracked plus untracked-but-not-ignored files, or `git archive REF`, in a temporary
folder): the working tree is never mutated.

First the module's test selection runs once on the unmutated copy under coverage.py with one context per test
(tools/mutate_coverage.py), which tells which tests execute which line and which tests already fail there (those
are deselected and reported). Each mutant then runs only the tests that execute its line, with `-x`, one worker,
under `nice -n 10`; a mutant on a line no test runs survives without a run; one on a line only imports run gets
the file's whole selection. A failing run kills the mutant; a run past --timeout is a timeout (not a kill).

The tests written against survivors (NEW_KILL_TESTS) always run last, so a mutant whose first failure is in them
passed every older test: the report gives the score with and without them from one run.

Equivalent mutants (no test can tell them from the original) are listed in EQUIVALENT below, each with the reason;
they are reported and left out of the score: killed / (killed + survived + timeout).

The score that counts is the one AS RUN on a FRESH seed: without --seed a seed is drawn from os.urandom and printed
with the time and the commit, so it cannot have been used to write the tests it is scored with (tests written for
the survivors of a sample always score that sample well; a sample drawn after them says how the suite does on
mutants nobody looked at). Target: >= 90 % as run. A run with --seed, a rescored run (--rescore: today's EQUIVALENT
list on an older run) and the "without the kill tests" column are secondary figures.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TARGET = 90.0  # % killed as run on a fresh seed

# module name -> (files to mutate, the fast test selection that runs against each mutant); BY_FILE narrows the
# selection for mutants of one file (first match of a path prefix wins), so a surviving mutant costs less
KILLS = "tests/engine/test_mutation_kills.py"
ADAPTER_KILLS = "tests/comfy/test_comfy_nodes_kills.py"
FRESH_KILLS = "tests/engine/test_mutation_kills_fresh.py"  # for the survivors of the first fresh-seed sample
# The tests written to kill survivors run LAST against every mutant: with -x, a mutant whose first failure is in
# one of these files passed every older test, so one run tells which mutants the suite killed before them
NEW_KILL_TESTS = (KILLS, FRESH_KILLS, ADAPTER_KILLS)
E = "tests/engine/"
GRADS = [E + "test_sdpa_autograd.py", E + "test_ops.py", E + "test_transforms.py", E + "test_sdpa_memory.py", KILLS,
         FRESH_KILLS]
BY_FILE = [  # test files that do not exist in the mutated tree are dropped (the layout is moving)
    ("attention_core/autograd.py", GRADS),
    ("attention_core/tiers/backward.py", GRADS),
    ("attention_core/memory.py", [E + "test_sdpa_memory.py", E + "test_memory_estimates.py", KILLS]),
    ("attention_core/oom.py", [E + "test_sdpa_memory.py", KILLS]),
    ("attention_core/detection.py", [E + "test_detect_patch_ffn.py", E + "test_detection.py", KILLS]),
    ("attention_core/patch.py", [E + "test_detect_patch_ffn.py", E + "test_global_patch.py", KILLS]),
    ("attention_core/ffn.py", [E + "test_detect_patch_ffn.py", E + "test_ffn_chunking.py", E + "test_ffn_compile.py",
                               KILLS, FRESH_KILLS]),
    ("attention_core/parallel.py", [E + "test_parallel.py", E + "test_parallel_kv_copies.py"]),
    ("attention_core/selfcheck.py", [E + "test_detect_patch_ffn.py", E + "test_detection.py", KILLS]),
]
# files whose tests run them in worker processes (torch.distributed groups) that the coverage run does not trace:
# their mutants run the file's BY_FILE selection instead of the tests coverage saw on the line (none)
SUBPROCESS_TESTED = {"attention_core/parallel.py"}
# test files about the patch, FFN and detection only: not run against mutants of the attention math
NOT_CORE = {E + "test_detect_patch_ffn.py", E + "test_detection.py", E + "test_ffn_chunking.py",
            E + "test_global_patch.py"}
# slow test files (real transformers/diffusers models) left out of the engine selection, and slow tests
# (torch.compile: minutes per run on 2 cores) deselected by node-id prefix
SLOW = {E + "test_global_patch_models.py"}
SLOW_TESTS = ["engine/test_transforms.py::test_torch_compile"]
MODULES = {
    "engine": {
        # bench.py is the benchmark CLI (timings and a table), not engine behaviour: not mutated
        "files": ["attention_core/**/*.py"],  # but not bench.py (see module_files)
        "tests": ["tests/engine"],
    },
    "adapter": {
        "files": ["nodes/comfy_adapter.py"],
        "tests": ["tests/comfy/test_comfy_nodes.py", ADAPTER_KILLS],
    },
}

# Equivalent mutants, examined by hand: (file glob, the original line, the mutated line, why no test can kill it).
# Lines are compared stripped, so the entries survive unrelated edits that move them.
EQUIVALENT = [
    ("nodes/comfy_adapter.py", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode < "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("nodes/comfy_adapter.py", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode <= "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("nodes/comfy_adapter.py", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode is "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("attention_core/tiles.py",
     "if p.causal and j1 - 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "if p.causal and j1 - 1 > i0 | p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "i0 >= 0, so i0 | offset = i0 + offset - (i0 & offset) <= i0 + offset: the test only widens, and the causal "
     "masked_fill it lets through more often is a no-op there"),
    ("attention_core/ffn.py",
     "return max(1, min(n, math.ceil(act_bytes / max(1, free * AUTO_SHARE))))",
     "return max(1, min(n, math.ceil(act_bytes / max( 0, free * AUTO_SHARE))))",
     "free is at least 1 byte (0 is replaced by 4 GiB) and AUTO_SHARE > 0, so the floor of the divisor only "
     "matters below 1 byte, where both give n chunks"),
    ("attention_core/tiles.py", "if p.causal and j1 - 1 > i0:  # some key in the tile is right of some row's diagonal",
     "if p.causal and j1 // 1 > i0:  # some key in the tile is right of some row's diagonal",
     "the test only skips a no-op: with j1 - 1 == i0 no key is right of any row's diagonal, so the causal "
     "masked_fill it now also runs changes nothing"),
    ("attention_core/tiles.py",
     "if p.causal and j1 - 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "if p.causal and j1 // 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "the test only skips a no-op: with j1 - 1 == i0 + offset no key is right of any row's diagonal"),
    ("attention_core/parallel.py", "meta += [0.0] * (_META - len(meta))", "meta += [0.0] * (_META + len(meta))",
     "only more zero padding, which meta[:_META] cuts off on the next line"),
    ("attention_core/ffn.py",
     "if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \\",
     "if not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)) or a.shape != b.shape \\",
     "_close's only caller (_check) passes two tensors or b = None; with None the mutant raises AttributeError, "
     "which _check catches and answers False, as the original does"),
    ("attention_core/problem.py", "seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())",
     "seed = int(torch.randint( -1, 2 ** 62, (1,), dtype=torch.int64).item())",
     "a seed of -1 (one draw in 2**62) is as good a seed for the xor-multiply hash as any other"),
    ("attention_core/ops.py", "if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:",
     "if p.Lq == 0 or p.B <= 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:",
     "p.B is a tensor size, never negative"),
    ("attention_core/tiles.py", "kt = k[:, :, j0:j1].transpose(-1, -2)", "kt = k[:, :, j0:j1].transpose(-1, 2)",
     "k is always 4-D (B, Hkv, Lk, E), so dim 2 is dim -2"),
    ("attention_core/parallel.py",
     "if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:",
     "if tuple(window_size) > (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:",
     "flash-attn window sizes are -1 (unbounded) or >= 0, and every such pair other than (-1, -1) compares "
     "greater than it"),
    ("attention_core/memory.py", "if p.dropout_p > 0:", "if p.dropout_p != 0:",
     "only a negative dropout_p (rejected by sdpa; meaningless in ops) would differ, and then only the tile "
     "size estimate grows: results are the same"),
]


def _empty_guard_equivalents():
    """ops.py's empty-problem test (the same line in the forward and the backward): the Lq, B, Hkv and G terms are
    shortcuts. With one of those sizes zero the tiers return the same empty output and zero gradients without the
    term (test_empty_problems_give_torchs_answer_and_gradients compares every empty dimension with torch; each of
    these mutants was applied by hand and passed it; for G also with masks, dropout, fp16/bf16 and every tier). So a
    mutant that only weakens one of them (sizes are never negative) or joins two of them with `and` is equivalent.
    Not the Lk term: the forward needs it (no keys: zeros, where the tiers give NaN). Its backward twin is a
    shortcut too, but the line is the same text in both places, so those mutants are judged by their run."""
    line = "if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:"
    why = ("the term is a shortcut: for this empty dimension the tiers give the same empty output and zero "
           "gradients without it (sizes are never negative)")
    terms = ["Lq", "B", "Hkv", "G"]
    out = [("attention_core/ops.py", line, line.replace(f"p.{t} == 0", f"p.{t} {op}"), why)
           for t in terms for op in ("< 0", "<= 0", "== -1")]
    out += [("attention_core/ops.py", line, line.replace(f"p.{a} == 0 or p.{b} == 0", f"p.{a} == 0 and p.{b} == 0"),
             why) for a, b in zip(terms, terms[1:])]
    return out


EQUIVALENT += [e for e in _empty_guard_equivalents() if e[1:3] not in {x[1:3] for x in EQUIVALENT}]
EQUIVALENT += [
    ("attention_core/ffn.py",
     "if not isinstance(y, torch.Tensor) or y.dim() != x.dim() or y.shape[dim] != size:",
     "if not isinstance(y, torch.Tensor) or y.dim() is not x.dim() or y.shape[dim] != size:",
     "tensor ranks are small ints, which CPython caches: `is not` is `!=` for them (piece lengths are not: "
     "`is not` on y.shape[dim] is killed by test_pieces_longer_than_256_tokens_are_chunked_exactly)"),
    ("attention_core/autograd.py", "if in_dims[9] is not None:", "if in_dims[ 10] is not None:",
     "the backward's seed is the one the forward saved: a vmapped seed is refused by the forward rule "
     "(test_dropout_under_vmap_with_different_randomness_names_the_seed), so no public call reaches the backward "
     "rule with one; only a direct vmap of the tiled_attention::bwd op would"),
    ("attention_core/parallel.py", "rep = rep if g % rep == 0 else g", "rep = rep if g % rep <= 0 else g",
     "g % rep is never negative"),
    ("attention_core/parallel.py", "rep = rep if g % rep == 0 else g", "rep = rep if g % rep >= 0 else g",
     "the else is unreachable: P divides H = Hkv * g, so rep = P // gcd(Hkv, P) divides g"),
] + [("attention_core/parallel.py", "g = H // Hkv", f"g = H {op} Hkv",
       "g only decides `rep if g % rep == 0 else g`; Ulysses requires P | H and rep divides P, so this g (a "
       "multiple of H, H / Hkv as a float, or 0) is a multiple of rep whenever the true one is") for op in
     ("*", "/", "%", "**", "<<")
] + [("attention_core/parallel.py",
      "if Hkv % P:  # fewest kv-head copies so that kv heads split with their query heads",
      f"if Hkv {op} P:  # fewest kv-head copies so that kv heads split with their query heads",
      "the test only skips a no-op: with P | Hkv, rep = P // gcd(Hkv, P) = 1 and _repeat_kv returns k itself; the "
      "mutated test is true whenever Hkv % P is (Hkv >= 1, P >= 2)") for op in ("+", "-", "*", "/", "**", "<<", "|", "^")
] + [("attention_core/estimate.py", "if n <= pts[0][0]:", "if n < pts[0][0]:",
       "at n equal to the first count the loop's first pair gives t = 0.0 and r0 ** 1.0 * r1 ** 0.0 == r0 exactly; "
       "a single point falls through to the `>=` branch with the same rate"),
      ("attention_core/estimate.py", "if n >= pts[-1][0]:", "if n > pts[-1][0]:",
       "at n equal to the last count the last pair gives t == 1.0 and r0 ** 0.0 * r1 ** 1.0 == r1 exactly"),
      ("attention_core/calibrate.py", "g = torch.Generator().manual_seed(0)", "g = torch.Generator().manual_seed( 1)",
       "the seeded inputs are noise timed for speed only: no stored value depends on them"),
      ("attention_core/calibrate.py", "g = torch.Generator().manual_seed(0)", "g = torch.Generator().manual_seed( -1)",
       "the seeded inputs are noise timed for speed only: no stored value depends on them"),
] + [("attention_core/estimate.py", "f\"{st.cfg_batch * batch}{' (CFG)' if st.cfg_batch == 2 else ''}\")",
      f"f\"{{st.cfg_batch * batch}}{{' (CFG)' if st.cfg_batch {op} else ''}}\")",
      "Stage.cfg_batch is 1 or 2 in every stage of STAGES (small ints are cached, so `is` is `==`)")
     for op in (">= 2", "> 1", "is 2")
] + [("attention_core/estimate.py", "return pts[-1][1]", f"return pts[{i}][1]",
      "unreachable at the end of _interp: n strictly between the first and last counts lies in some pair")
     for i in ("-2", "- 1", "+1", "1", "0")
] + [("attention_core/cli_args.py", "def int_range(lo: int = 1, hi: int | None = None):",
       f"def int_range(lo: int = 1, hi: int {op} None = None):",
       "with `from __future__ import annotations` annotations are strings, never evaluated")
      for op in ("<<", ">>", "&", "^", "+", "-", "*", "/", "//", "%", "**")
] + [("attention_core/tune.py", 'if bkv > n and tier == "online":', f'if bkv > n and tier {op} "online":',
      "for chunked and inplace the only key block is n, so `bkv > n` is already False; for online both agree")
     for op in ("<=", ">=")
] + [("attention_core/tune.py", "g = torch.Generator().manual_seed(0)", f"g = torch.Generator().manual_seed({x})",
      "tune_shape's and layout_check's seeded inputs are noise timed for speed only (the layout check's "
      "exactness figure is printed, not kept, and holds for any inputs)")
     for x in (" 1", " -1")
] + [("attention_core/plan.py", "steps = 1 if need <= free else 2 ** math.ceil(math.log2(need / free))",
       "steps = 1 if need < free else 2 ** math.ceil(math.log2(need / free))",
       "at need == free the else branch gives 2 ** ceil(log2(1.0)) = 1, the same count"),
      ("attention_core/plan.py",
       'copied = layout == "comfyui" or compute != dtype or (batch > 1 and not all_heads)',
       'copied = layout == "comfyui" or compute > dtype or (batch > 1 and not all_heads)',
       "compute_dtype changes a dtype only fp16 -> fp32, bf16 -> fp32 or bf16 -> fp16, and each compares greater "
       "as a string (\"fp32\" > \"fp16\" > \"bf16\")"),
      ("attention_core/plan.py",
       'note = "" if sp["rows"] != n or sp["steps"] == 1 else f"; N does not divide by {sp[\'steps\']}: no slicing"',
       'note = "" if sp["rows"] != n or sp["steps"] <= 1 else f"; N does not divide by {sp[\'steps\']}: no slicing"',
       "the slice count is 1 or a power of two, never below 1"),
      ("attention_core/plan.py",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "return max( 0, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "min(n, ceil of a positive number) is already at least 1 (n >= 1)"),
      ("attention_core/plan.py",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max( 2, free * AUTO_SHARE))))",
       "the feed-forward bytes are at least 2 N, so a divisor up to 2 still gives >= N chunks, capped at N"),
] + [("attention_core/multidevice.py",
       "if mask.dim() >= 3 and mask.shape[-3] == q_heads and q_heads > 1:",
       f"if mask.dim() >= 3 and mask.shape[-3] == q_heads and q_heads {op}:",
       "with one query head there is one group, and its slice [..., 0:1, :, :] of a mask whose head dim is 1 is "
       "the whole mask") for op in (">= 1", "> 0")
] + [("attention_core/parallel.py", "_META = 40", f"_META = {x}",
      "the description has 30 entries and every rank pads to the same length: only zero padding changes")
     for x in ("41", "39")
] + [("attention_core/parallel.py", "code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 9",
      f"code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else {x}",
      "any code from 5 up prints as \"other\" and equals no listed dtype's code; every rank computes the same")
     for x in ("10", "8")
] + [("attention_core/detection.py",
       '"efficient": lambda q: aten._scaled_dot_product_efficient_attention(q, q, q, None, False)[0]}',
       '"efficient": lambda q: aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[0]}',
       "the probe only asks whether the kernel runs; compute_log_sumexp adds an output and [0] is the attention "
       "output either way (GPU-only code)")
] + [("attention_core/patch.py", "_config = (False, {})", "_config = (True, {})",
       "_refresh sets this default only when nothing asks for the patch, and removes the patch in the same call; "
       "_patched_sdpa returns torch's own result whenever the patch is not installed, before `force` is used (only "
       "a call on another thread racing the last block's exit, between the two assignments, could see it)")
] + [("attention_core/tune.py", 'shrink_kv=tier == "online")', 'shrink_kv=tier >= "online")',
       "the tiers are chunked, inplace and online, and only \"online\" sorts at or after \"online\"")
] + [("attention_core/estimate.py", "if n0 <= n <= n1:", f"if n0 {op} n <= n1:",
       "n lies strictly inside the (distinct, sorted) measured token counts here, so the first pair with n <= n1 "
       "has n0 < n: the left test is true in the original and the mutant alike") for op in ("!=", "<", "is not")
] + [("attention_core/estimate.py", "if n0 <= n <= n1:", "if n0 <= n < n1:",
       "when n equals a measured count n1 the lookup moves on to the next pair, whose n0 is n: t = 0 there and "
       "r0 ** 1.0 * r1 ** 0.0 is that same measured rate, bit for bit (the last count returns before the loop)")
]
# Examined and NOT listed: `p.dropout_p > 0` -> `!= 0` in the tiers. Equivalent through sdpa (normalize() rejects
# dropout_p outside [0, 1]), but ops.attention_forward/backward pass dropout_p on unvalidated, so a negative one
# reaches the tiers there.


@dataclasses.dataclass
class Mutant:
    module: str
    path: str
    operator: str
    occurrence: int
    line: int
    before: str
    after: str
    diff: str
    start_line: int = 0
    tests: int = 0  # how many tests ran against it (0: the module's whole selection)
    outcome: str = "pending"  # killed | survived | timeout | incompetent | equivalent
    seconds: float = 0.0
    why: str = ""
    output: str = ""  # the first failing test of a killed mutant
    by_new_tests: bool = False  # killed, but only by the tests in NEW_KILL_TESTS

    def key(self):
        return self.path, self.before.strip(), self.after.strip()


def equivalent_reason(m: Mutant):
    import fnmatch
    for path, before, after, why in EQUIVALENT:
        if fnmatch.fnmatch(m.path, path) and (before.strip(), after.strip()) == m.key()[1:]:
            return why
    return None


def copy_tree(dest: Path, ref=None) -> Path:
    """The tracked and untracked-but-not-ignored files of the tree (or the tree of git revision `ref`), copied to
    dest: the mutants' playground."""
    if ref:
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "xf", "-", "-C", str(dest)], input=archive, check=True)
        files = []
    else:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if not src.is_file() or src.is_symlink():
            continue
        out = dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    cache = ROOT / ".cache"
    if cache.exists():  # the stock ComfyUIs the tests import (read only)
        os.symlink(cache.resolve(), dest / ".cache")
    return dest


def enumerate_mutants(tree: Path, module: str, operators):
    """Every mutant Cosmic Ray's core operators make of the module's files (in the copy at `tree`); the mutated
    code (a parse per mutant) is made later, by `describe`, for the sampled ones only."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.commands.init import _operators

    mutants = []
    for rel in module_files(module, tree):
        module_ast = get_ast_from_path(tree / rel)
        nodes = list(ast_nodes(module_ast))
        for op_name, _op_args, op in _operators({}):
            if operators and not any(re.search(o, op_name) for o in operators):
                continue
            positions = [pos for node in nodes for pos in op.mutation_positions(node)]
            for occurrence, (start, _end) in enumerate(positions):
                mutants.append(Mutant(module, rel, op_name, occurrence, start[0], "", "", "", start_line=start[0]))
    return mutants


def describe(tree: Path, m: Mutant) -> bool:
    """Fill in the mutant's diff and changed line; False when the operator makes no change there."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    source = (tree / m.path).read_text(encoding="utf-8")
    try:
        mutated = mutate_code(source, cosmic_ray.plugins.get_operator(m.operator)(), m.occurrence)
    except Exception as e:  # noqa: BLE001 - Cosmic Ray 8.7's ExceptionReplacer fails on dotted names
        # (`except (OSError, subprocess.SubprocessError)`: AttributeError 'PythonNode' has no 'value'): no mutant
        m.why = f"Cosmic Ray could not make this mutant ({e.__class__.__name__}: {e})"
        return False
    if mutated is None or mutated == source:
        return False
    m.before, m.after, m.diff, m.line = _line_diff(source, mutated, m.path, m.line)
    return True


def _line_diff(source: str, mutated: str, rel: str, line: int):
    a, b = source.split("\n"), mutated.split("\n")
    diff = "\n".join(difflib.unified_diff(a, b, f"a/{rel}", f"b/{rel}", n=1, lineterm=""))
    changed_a = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = changed_a[0] if changed_a else line - 1
    before = a[first] if first < len(a) else ""
    after = b[first] if first < len(b) else ""
    if len(a) != len(b):  # a whole statement changed (e.g. a removed decorator): key on the diff body
        body = [ln for ln in diff.splitlines()[2:] if ln[:1] in "+-"]
        before = " | ".join(ln for ln in body if ln.startswith("-"))
        after = " | ".join(ln for ln in body if ln.startswith("+"))
    return before, after, diff, first + 1


def module_files(module: str, tree: Path):
    """The module's files in the mutated tree (the layout differs between revisions). attention_core/bench.py is
    the benchmark CLI (timings and a table), not engine behaviour: not mutated."""
    files = set()
    for pattern in MODULES[module]["files"]:
        files.update(str(f.relative_to(tree)) for f in tree.glob(pattern) if f.is_file())
    return sorted(f for f in files if f != "attention_core/bench.py")


def tests_for(module: str, path: str, tree: Path):
    """The test files run against a mutant of `path` (those that exist in the copied tree)."""
    tests = next((t for prefix, t in BY_FILE if path.startswith(prefix)), None)
    if tests is None and MODULES[module]["tests"] == ["tests/engine"]:
        tests = sorted(str(f.relative_to(tree)) for f in (tree / "tests/engine").glob("test_*.py"))
        tests = [t for t in tests if t not in SLOW and t not in NOT_CORE and t != KILLS] + [KILLS]
    tests = [t for t in (tests or MODULES[module]["tests"]) if (tree / t).exists()]
    return sorted(tests or MODULES[module]["tests"], key=lambda t: t in NEW_KILL_TESTS)


def pytest_command(module: str, deselect=(), tests=None):
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-c", "tests/pytest.ini", "--rootdir", "tests", "-W", "ignore::DeprecationWarning"]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    return cmd + list(tests or MODULES[module]["tests"])


def all_tests(module: str, tree: Path):
    """The union of the module's per-file selections: what the baseline runs."""
    files = set()
    for rel in module_files(module, tree):
        files.update(tests_for(module, rel, tree))
    return sorted(files, key=lambda t: (t in NEW_KILL_TESTS, t))


def baseline(tree: Path, module: str, tests, timeout: float, deselect=()):
    """Run the selection once on the unmutated copy under coverage (one context per test).

    Returns (node ids of tests that already fail, {file: {line: set of node ids}}, seconds). Lines run only
    outside tests (imports) map to {""}."""
    import coverage

    data_file = tree.parent / f".coverage-{module}"
    cmd = pytest_command(module, deselect, tests=tests)
    cmd.remove("-x")
    plugin_dir = tree.parent / "plugin"  # the plugin from this checkout, also when --ref mutates another tree
    plugin_dir.mkdir(exist_ok=True)
    shutil.copy(ROOT / "tools" / "mutate_coverage.py", plugin_dir / "mutate_coverage_plugin.py")
    env = dict(os.environ, MUTATE_COVERAGE_FILE=str(data_file), MUTATE_TREE=str(tree),
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    proc = subprocess.run(cmd + ["-rf", "-p", "mutate_coverage_plugin"], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env=env)
    failing = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    failing = [f.split("tests/", 1)[-1] if f.startswith("tests/") else f for f in failing]
    if proc.returncode not in (0, 1) or not data_file.exists():
        raise SystemExit(f"mutate: the {module} test selection does not run on the unmutated tree "
                         f"(pytest exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    data = coverage.CoverageData(str(data_file))
    data.read()
    lines = {}
    for fname in data.measured_files():
        try:
            rel = str(Path(fname).resolve().relative_to(tree.resolve()))
        except ValueError:
            continue
        lines[rel] = {ln: set(ctx) for ln, ctx in data.contexts_by_lineno(fname).items()}
    return failing, lines, time.time() - t0


def covering_tests(m: "Mutant", lines: dict, deselect=()):
    """Node ids (relative to tests/) of the tests that run the mutated line; [""] if only imports run it."""
    per_line = lines.get(m.path, {})
    ids = set()
    for ln in {m.start_line, m.line}:
        ids |= per_line.get(ln, set())
    ids = {i for i in ids if not any(i.startswith(d) for d in deselect)}
    if ids and ids <= {""}:
        return [""]
    return sorted((i for i in ids if i), key=lambda i: (("tests/" + i.split("::")[0]) in NEW_KILL_TESTS, i))


def run_mutant(tree: Path, m: Mutant, cmd, timeout: float):
    """Mutate the copy through Cosmic Ray, run the tests, restore the file."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.testing import run_tests

    op = cosmic_ray.plugins.get_operator(m.operator)()
    t0 = time.time()
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        with use_mutation(Path(m.path), op, m.occurrence) as (_orig, mutated):
            if mutated is None:
                m.outcome = "incompetent"
                return m
            outcome, output = run_tests(" ".join(_quote(c) for c in cmd), timeout)
    finally:
        os.chdir(cwd)
    m.seconds = time.time() - t0
    if output == "timeout":
        m.outcome = "timeout"
    else:
        m.outcome = "killed" if outcome.value == "killed" else "survived"
        if m.outcome == "killed":
            first = re.search(r"^(FAILED|ERROR) .*$", output, re.M)
            m.output = first.group(0) if first else output.strip().splitlines()[-1:][0] if output.strip() else ""
            m.by_new_tests = any(f" {t.split('tests/', 1)[1]}" in m.output or f" {t}" in m.output
                                 for t in NEW_KILL_TESTS)
    return m


def _quote(s: str) -> str:
    import shlex
    return shlex.quote(s)


def score(ms):
    k = sum(m.outcome == "killed" for m in ms)
    s = sum(m.outcome == "survived" for m in ms)
    t = sum(m.outcome == "timeout" for m in ms)
    e = sum(m.outcome == "equivalent" for m in ms)
    total = k + s + t
    return k, s, t, e, (100.0 * k / total if total else 100.0)


def choose_seed(given: Optional[int], entropy: Optional[bytes] = None, now: Optional[float] = None) -> dict:
    """The sample's seed: `given` (--seed: a repeat, not a fresh sample), else a fresh one from os.urandom, with the
    time it was drawn and the commit whose tests it scores (+ "with uncommitted changes" for a dirty tree)."""
    fresh = given is None
    seed = int.from_bytes(entropy or os.urandom(4), "big") % 1_000_000 if fresh else given
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now if now is not None else time.time()))
    return {"seed": seed, "fresh": fresh, "drawn_at": when if fresh else None, "commit": _commit()}


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if dirty else "")


def headline(module: str, ms, meta: dict, rescored: bool = False) -> str:
    """The line that states the score: as run on a fresh seed (the figure that counts) or a secondary figure."""
    k, s, t, e, pct = score(ms)
    where = f"commit {meta.get('commit', 'unknown')}"
    if meta.get("fresh"):
        seed = f"fresh seed {meta['seed']}, drawn at {meta['drawn_at']}, after the tests of {where}"
    else:
        seed = f"seed {meta.get('seed')} given with --seed (a repeat, NOT a fresh sample), tests of {where}"
    verdict = "meets" if pct >= TARGET else "BELOW"
    kind = ("RESCORED with today's EQUIVALENT list (secondary; the as-run figure of a fresh seed is the one that "
            "counts)" if rescored else "as run" if meta.get("fresh") else "as run on a given seed (secondary)")
    return (f"{module}: {kind}: {k} killed / {k + s + t} ({s} survived, {t} timeout) = {pct:.1f}% "
            f"({verdict} the {TARGET:.0f}% target); {e} equivalent listed separately; {seed}")


def report(results: dict, totals: dict, deselected: dict, args, out=sys.stdout, meta: Optional[dict] = None,
           rescored: bool = False):
    w = out.write
    meta = meta or {"seed": args.seed, "fresh": False, "commit": "unknown"}
    w(f"\n# Mutation testing (cosmic-ray; {'fresh ' if meta.get('fresh') else ''}seed {meta.get('seed')}, "
      f"sample {meta.get('sample', args.sample) or 'all'} per module)\n\n")
    for module, ms in results.items():
        w(f"**{headline(module, ms, meta, rescored)}**\n\n")
    w("| module | mutants | sampled | killed | survived | timeout | equivalent | score | without the kill tests |\n")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for module, ms in results.items():
        k, s, t, e, pct = score(ms)
        new = sum(m.by_new_tests for m in ms)
        old = 100.0 * (k - new) / (k + s + t) if k + s + t else 100.0
        w(f"| {module} | {totals[module]} | {len(ms)} | {k} | {s} | {t} | {e} | {pct:.1f}% | "
          f"{k - new} killed, {old:.1f}% |\n")
    for module, ms in results.items():
        if deselected.get(module):
            w(f"\n{module}: deselected (failing on the unmutated tree, or slow): {', '.join(deselected[module])}\n")
        surv = [m for m in ms if m.outcome in ("survived", "timeout")]
        w(f"\n## {module}: {len(surv)} survivor(s)\n")
        for m in sorted(surv, key=lambda m: (m.path, m.line)):
            w(f"\n{m.path}:{m.line} {m.operator} ({m.outcome}{', ' + m.why if m.why else ''})\n```diff\n{m.diff}\n```\n")
        eq = [m for m in ms if m.outcome == "equivalent"]
        if eq:
            w(f"\n### {module}: equivalent mutants (not scored)\n")
            for m in sorted(eq, key=lambda m: (m.path, m.line)):
                w(f"- {m.path}:{m.line} `{m.before.strip()}` -> `{m.after.strip()}`: {m.why}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="./dev mutate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", choices=sorted(MODULES) + ["all"], default="all",
                    help="engine (attention_core/) or adapter (nodes/comfy_adapter.py); default all")
    ap.add_argument("--file", action="append", default=[],
                    help="only mutants in files whose path contains this (repeatable), e.g. --file tiles.py")
    ap.add_argument("--sample", type=int, default=40, help="mutants per module, a seeded random sample (0 = all)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sample (default: a fresh one from os.urandom, printed; the score that counts "
                         "is the as-run score of a fresh seed: a given seed repeats a sample)")
    ap.add_argument("--timeout", type=float, default=0,
                    help="seconds per mutant's test run (default: 2 x the unmutated run, at least 120)")
    ap.add_argument("--operator", action="append", default=[],
                    help="only Cosmic Ray operators matching this regex (repeatable), e.g. --operator Comparison")
    ap.add_argument("--tests", nargs="+", help="override the module's test selection (paths under tests/)")
    ap.add_argument("--ref", help="mutate the tree of this git revision (e.g. main) instead of the working tree")
    ap.add_argument("--deselect", action="append", default=[], help="a test node id to leave out (repeatable)")
    ap.add_argument("--skip-baseline", action="store_true",
                    help="do not run the selection once under coverage first: every mutant then runs its file's "
                         "whole selection (slow), and tests that already fail must be passed with --deselect")
    ap.add_argument("--list", action="store_true", help="count the mutants, run nothing")
    ap.add_argument("--rescore", metavar="JSON",
                    help="no run: re-read a --json file, apply the current EQUIVALENT list, print the report")
    ap.add_argument("--json", help="also write every mutant's outcome to this JSON file")
    ap.add_argument("--report", help="also write the markdown report to this file")
    args = ap.parse_args(argv)

    if args.rescore:
        with open(args.rescore, encoding="utf-8") as f:
            data = json.load(f)
        meta = data.pop("_meta", {"seed": "?", "fresh": False, "commit": "unknown"})
        results = {mod: [Mutant(**m) for m in ms] for mod, ms in data.items()}
        for ms in results.values():
            for m in ms:
                why = equivalent_reason(m) if m.diff else None
                if why and m.outcome in ("survived", "timeout"):
                    m.outcome, m.why = "equivalent", why
        totals = {mod: "?" for mod in results}
        report(results, totals, {}, args, meta=meta, rescored=True)
        return 0
    os.environ.setdefault("COMFYUI_PATH", str(ROOT / ".cache" / "comfyui-0.3.75"))
    os.environ.setdefault("COMFYUI_LATEST_PATH", str(ROOT / ".cache" / "comfyui-0.33.0"))
    modules = sorted(MODULES) if args.module == "all" else [args.module]
    meta = {**choose_seed(args.seed), "sample": args.sample}
    args.seed = meta["seed"]
    if not args.list:
        print(f"[mutate] {'fresh seed' if meta['fresh'] else 'seed (given)'} {meta['seed']}"
              + (f", drawn at {meta['drawn_at']}" if meta["fresh"] else "")
              + f"; tests of commit {meta['commit']} (repeat this sample with --seed {meta['seed']})",
              file=sys.stderr, flush=True)
    results, totals, deselected = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="tiled-attention-mutants-") as tmp:
        tree = copy_tree(Path(tmp) / "tree", args.ref)
        for module in modules:
            ms = enumerate_mutants(tree, module, args.operator)
            if args.file:
                ms = [m for m in ms if any(f in m.path for f in args.file)]
            totals[module] = len(ms)
            if args.list:
                per_file = {}
                for m in ms:
                    per_file[m.path] = per_file.get(m.path, 0) + 1
                print(f"{module}: {len(ms)} mutants")
                for path, n in sorted(per_file.items()):
                    print(f"  {path}: {n}")
                continue
            if args.sample and len(ms) > args.sample:
                ms = random.Random(f"{args.seed}:{module}").sample(ms, args.sample)
            lines = None
            if args.skip_baseline:
                failing, base_s = [], 200.0
            else:
                failing, lines, base_s = baseline(tree, module, args.tests or all_tests(module, tree),
                                                  max(args.timeout * 10, 3600),
                                                  SLOW_TESTS if module == "engine" else [])
            deselected[module] = failing + args.deselect + (SLOW_TESTS if module == "engine" else [])
            timeout = args.timeout or max(120.0, 2 * base_s)
            print(f"[mutate] {module}: {len(ms)} of {totals[module]} mutants; unmutated run {base_s:.0f}s, "
                  f"timeout {timeout:.0f}s" + (f"; deselected (already failing): {failing}" if failing else ""),
                  file=sys.stderr, flush=True)
            for n, m in enumerate(ms, 1):
                why = equivalent_reason(m) if describe(tree, m) else None
                if not m.diff:
                    m.outcome = "incompetent"
                elif why:
                    m.outcome, m.why = "equivalent", why
                else:
                    tests = args.tests or tests_for(module, m.path, tree)
                    if lines is not None and m.path not in SUBPROCESS_TESTED:
                        ids = covering_tests(m, lines, deselected[module])
                        if not ids and not any(m.path.startswith(prefix) for prefix, _ in BY_FILE):
                            m.outcome, m.why = "survived", "no test runs this line"
                        elif not ids:  # code coverage cannot see (traced by torch.compile): the file's tests
                            m.why = "no coverage record (e.g. run while dynamo traces): ran the file's tests"
                        elif ids != [""]:
                            tests, m.tests = ["tests/" + i for i in ids], len(ids)
                    if m.outcome == "pending":
                        cmd = pytest_command(module, deselected[module], tests)
                        run_mutant(tree, m, cmd, timeout)
                print(f"[mutate] {module} {n}/{len(ms)} {m.outcome:9s} {m.path}:{m.line} {m.operator} "
                      f"({m.seconds:.0f}s, {m.tests or 'all'} tests){' ' + m.why if m.why else ''}",
                      file=sys.stderr, flush=True)
            results[module] = ms
    if args.list:
        return 0
    report(results, totals, deselected, args, meta=meta)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            report(results, totals, deselected, args, out=f, meta=meta)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"_meta": meta, **{mod: [dataclasses.asdict(m) for m in ms] for mod, ms in results.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
