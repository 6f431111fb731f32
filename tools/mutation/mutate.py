"""Mutation testing of the engine (attention_core/) and the ComfyUI nodes (every file of nodes/).

    ./dev mutate                                   both modules, 40 mutants each, a FRESH seed (printed, logged)
    ./dev mutate --module engine --sample 0        every engine mutant (hours on 2 cores)
    ./dev mutate --module nodes --sample 20 --seed 3 --timeout 300
    ./dev mutate --module engine --file tiles.py --operator Comparison
    ./dev mutate --ref main                        mutate the tree of another revision (with its own tests)
    ./dev mutate --list                            count the mutants per file, run nothing
    ./dev mutate --check-equivalents               name the EQUIVALENT entries whose line no longer exists

Cosmic Ray (cosmic-ray on PyPI, pinned in tests/requirements-test.txt) makes the mutants with its core operators
and applies each one: it writes the mutated module to disk, the tests run, the file is put back. Here that
happens in a COPY of the tree (tracked plus untracked-but-not-ignored files, or `git archive REF`, in a temporary
folder): the working tree is never mutated.

The sample is drawn first (--sample per module, default 40, from every mutant of the module's files). Then the
test selections of the sampled files only (BY_FILE below) run once on the unmutated copy under coverage.py with
one context per test (tools/mutation/mutate_coverage.py), which tells which tests execute which line and which tests
already fail there (those are deselected and reported). Each mutant then runs only the tests that execute its
line, with `-x`, one worker, under `nice -n 10`; a mutant on a line no test runs survives without a run; one on a
line only imports run gets the file's whole selection. A failing run kills the mutant; a run past --timeout is a
timeout (not a kill). The JSON (--json) and the report (--report), by default in .cache/mutation/, are rewritten
after every mutant: a run that crashes or is stopped leaves a partial report (--rescore reads it).

The tests written against survivors (NEW_KILL_TESTS) always run last, so a mutant whose first failure is in them
passed every older test: the report gives the score with and without them from one run.

Equivalent mutants (no test can tell them from the original) are listed in EQUIVALENT below, each with the reason
and keyed to the line's place (file, enclosing function, which identical line there); they are reported and left
out of the score: killed / (killed + survived + timeout).

The score that counts is the one AS RUN on a FRESH seed: without --seed a seed is drawn from os.urandom and printed
with the time and the commit, so it cannot have been used to write the tests it is scored with (tests written for
the survivors of a sample always score that sample well; a sample drawn after them says how the suite does on
mutants nobody looked at). Target: >= 90 % as run. Every fresh draw, finished or not, is appended to
docs/mutation-draws.jsonl in the working tree when the run ends (seed, commit, date, counts), and docs/development.md states
each module's LATEST whole-module draw from it, not the best (tests/test_mutate_report.py checks). A run with
--seed (not logged), a rescored run (--rescore: today's EQUIVALENT list on an older run) and the "without the
kill tests" column are secondary figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]  # tools/mutation/mutate.py -> the repository
TARGET = 90.0  # % killed as run on a fresh seed

DRAWS_LOG = ROOT / "docs" / "mutation-draws.jsonl"  # every fresh draw, appended (in the real working tree)
PROGRESS_DIR = ROOT / ".cache" / "mutation"  # default --json / --report of a run (git-ignored)

# WHICH TESTS RUN AGAINST A MUTANT. Each module has files to mutate and a fallback test selection; BY_FILE gives
# the selection for the mutants of one file (the first entry whose path is a prefix of the file's wins). The
# coverage run covers only the selections of the files the sample drew, and each mutant then runs only the tests
# of its file's selection that execute its line. To add a test file: append it to the BY_FILE lists of the files
# it exercises (engine files without an entry get every tests/engine file except SLOW, NOT_CORE and the kill
# files; nodes files without one get NODE_TESTS). Files that do not exist in the mutated tree are dropped.
KILLS = "tests/engine/test_mutation_kills.py"
ADAPTER_KILLS = "tests/comfy/test_comfy_nodes_kills.py"
FRESH_KILLS = "tests/engine/test_mutation_kills_fresh.py"  # for the survivors of the first fresh-seed sample
# The tests written to kill survivors run LAST against every mutant: with -x, a mutant whose first failure is in
# one of these files passed every older test, so one run tells which mutants the suite killed before them
NEW_KILL_TESTS = (KILLS, FRESH_KILLS, ADAPTER_KILLS)
E = "tests/engine/"
C = "tests/comfy/"
GRADS = [E + "test_sdpa_autograd.py", E + "test_ops.py", E + "test_transforms.py", E + "test_sdpa_memory.py", KILLS,
         FRESH_KILLS]
# nodes/: the files marked comfy_inprocess (a real ComfyUI imported into the test process, so coverage sees the
# nodes run; the server tests run ComfyUI in another process, which it does not). test_compile_fullgraph.py
# (torch.compile, minutes) only for the files whose code runs while dynamo traces.
NODES, ROUTING, CLONES, FIT = C + "test_comfy_nodes.py", C + "test_attention_routing.py", C + "test_deep_clones.py", \
    C + "test_fit_node.py"
COMPILE = C + "test_compile_fullgraph.py"
EVERYWHERE = C + "test_everywhere_inprocess.py"  # the process-wide mode (Tiled Attention Everywhere)
AUTOCAST = C + "test_autocast_routes.py"  # every route under torch.autocast
# its state lines, switching while other threads run or compile, counts under torch.compile
EVERYWHERE_MORE = [C + "test_everywhere_state.py", C + "test_everywhere_concurrency.py",
                   C + "test_everywhere_counts.py"]
SCHEMAS = C + "test_node_schemas.py"  # every node's widgets against the snapshot (seconds)
NOTICE = C + "test_override_notice.py"  # a later node replacing Patch Attention's override; the heads error's route
NODE_TESTS = [NODES, ROUTING, CLONES, FIT, EVERYWHERE, SCHEMAS, ADAPTER_KILLS]
BY_FILE = [
    # the forward-mode Function and plain_attention (what torch.compile traces under forward-mode AD) are tested
    # by test_forward_ad.py only
    ("attention_core/kernel/autograd.py", GRADS + [E + "test_forward_ad.py", E + "test_coverage_kernel.py",
                                                   E + "test_compiled_counts.py", E + "test_op_namespace.py",
                                                   E + "test_other_thread_compiling.py"]),
    ("attention_core/kernel/tiers/backward.py", GRADS + [E + "test_tile_defaults.py"]),  # its peak memory
    ("attention_core/kernel/memory.py", [E + "test_sdpa_memory.py", E + "test_memory_estimates.py",
                                         E + "test_coverage_kernel.py", E + "test_tile_defaults.py", KILLS]),
    ("attention_core/kernel/oom.py", [E + "test_sdpa_memory.py", KILLS]),
    ("attention_core/device/detection.py", [E + "test_detection.py", E + "test_coverage_cli_device.py", KILLS]),
    ("attention_core/patch.py", [E + "test_global_patch.py", E + "test_coverage_ffn_patch.py", KILLS,
                                 E + "test_patch_concurrency.py", E + "test_compiled_counts.py"]),
    ("attention_core/ffn/", [E + "test_ffn_chunking.py", E + "test_ffn_compile.py", E + "test_coverage_ffn_patch.py",
                             KILLS, FRESH_KILLS]),
    ("attention_core/parallel/", [E + "test_parallel.py", E + "test_parallel_kv_copies.py", E + "test_autocast.py"]),
    ("attention_core/cli/selfcheck.py", [E + "test_detection.py", E + "test_coverage_cli_device.py",
                                     E + "test_torch_yardstick.py", KILLS]),
    ("nodes/__init__.py", [NODES, ROUTING, EVERYWHERE, ADAPTER_KILLS, SCHEMAS]),  # the extension: nodes, backend, env
    ("nodes/api.py", [NODES, SCHEMAS]),
    ("nodes/attention.py", [NODES, ROUTING, CLONES, NOTICE, ADAPTER_KILLS, SCHEMAS]),  # Patch Attention (MODEL, CLIP, VAE)
    ("nodes/backend_registry.py", [NODES, ROUTING, ADAPTER_KILLS]),
    ("nodes/clones.py", [CLONES, NODES, ROUTING, ADAPTER_KILLS]),
    ("nodes/comfy_adapter.py", [NODES, ROUTING, CLONES, EVERYWHERE, NOTICE, AUTOCAST, COMPILE, ADAPTER_KILLS,
                                C + "test_everywhere_counts.py"]),
    ("nodes/comfy_global_route.py", [EVERYWHERE, AUTOCAST, NODES, ADAPTER_KILLS] + EVERYWHERE_MORE),  # ComfyUI's global attention in the process-wide mode
    ("nodes/comfy_preferred_route.py", [C + "test_preferred_attention.py", EVERYWHERE, NODES]),  # a layer's own function
    ("nodes/connector_route.py", [ROUTING, CLONES, NODES, ADAPTER_KILLS]),  # LTX-2.3's text connectors
    ("nodes/everywhere.py", [EVERYWHERE, NODES, ADAPTER_KILLS] + EVERYWHERE_MORE),  # the process-wide mode: environment variable, state
    ("nodes/everywhere_node.py", [EVERYWHERE, NODES, SCHEMAS, C + "test_everywhere_state.py"]),  # Tiled Attention Everywhere
    ("nodes/ffn.py", [NODES, CLONES, COMPILE, SCHEMAS, ADAPTER_KILLS]),  # FFN Chunking
    ("nodes/fit.py", [FIT, NODES, SCHEMAS]),  # Attention Fit
    ("nodes/info.py", [NODES, EVERYWHERE, NOTICE, SCHEMAS, ADAPTER_KILLS, C + "test_everywhere_state.py"]),  # Attention Info, the start line
    ("nodes/object_routes.py", [ROUTING, CLONES, NODES]),
    ("nodes/override_notice.py", [NOTICE, NODES]),  # the check a Patch Attention clone runs when sampling starts
    ("nodes/text_encoder_route.py", [ROUTING, CLONES, NODES, AUTOCAST, ADAPTER_KILLS]),
    ("nodes/vae_route.py", [ROUTING, CLONES, NODES, EVERYWHERE, AUTOCAST]),
]
# files whose tests run them in worker processes (torch.distributed groups) that the coverage run does not trace:
# their mutants run the file's BY_FILE selection instead of the tests coverage saw on the line (none)
SUBPROCESS_TESTED = ("attention_core/parallel/",)  # path prefixes
# test files about the patch, FFN and detection only: not run against mutants of the attention math
NOT_CORE = {E + "test_detection.py", E + "test_ffn_chunking.py", E + "test_global_patch.py"}
# slow test files (real transformers/diffusers models) left out of the engine selection, and slow tests
# (torch.compile: minutes per run on 2 cores) deselected by node-id prefix
SLOW = {E + "test_global_patch_models.py"}
SLOW_TESTS = ["engine/test_transforms.py::test_torch_compile"]
# tests where one thread compiles while another switches the patch (holding torch.compile's compile lock): under
# coverage.py's tracer they deadlock (coverage calls its Python lock_data/unlock_data from the tracer; on the
# compiling thread dynamo's frame hook intercepts unlock_data and waits for the compile lock the switching thread
# holds, while that thread waits in lock_data for coverage's lock), so the coverage run would hang: left out of
# the mutation runs, as the slow ones are; ./dev test runs them
SLOW_TESTS += [
    "engine/test_patch_concurrency.py::test_a_switch_waits_for_a_trace_in_progress_and_the_next_call_recompiles",
    "engine/test_patch_concurrency.py::test_compiles_on_one_thread_while_another_switches",
    "engine/test_patch_concurrency.py::test_switches_that_could_deadlock_do_not",
    "comfy/test_everywhere_concurrency.py::test_compiles_while_another_thread_switches",
]
MODULES = {
    "engine": {
        # the benchmark CLI (timings and a table) is not engine behaviour, nor are the commands' aliases: not mutated
        "files": ["attention_core/**/*.py"],  # but not those (see module_files)
        "tests": ["tests/engine"],
    },
    "nodes": {  # every file of the ComfyUI node pack (until issue 22 only nodes/comfy_adapter.py, as "adapter")
        "files": ["nodes/*.py"],
        "tests": NODE_TESTS,
    },
}
ALIASES = {"adapter": "nodes"}  # the module's old name, still accepted by --module (and in old --json files)

# Equivalent mutants, examined by hand: (key, the original line, the mutated line, why no test can kill it).
# The key names WHERE the line is, so an entry never covers an identical line elsewhere:
#   "path/to/file.py::Scope.name"     the first line of that text (compared stripped) in that scope
#   "path/to/file.py::Scope.name#2"   the second such line in that scope (source order)
# Scope: the dotted qualified name of the innermost def or class around the line ("Class.method",
# "outer.inner"), "<module>" outside any. Keys survive edits that move the line, not edits of the line itself or
# of its scope's name: then the entry is STALE, `./dev mutate --check-equivalents` names it (tests/
# test_mutate_report.py fails on it) and the mutant must be examined again.
EQUIVALENT = [
    ("nodes/comfy_adapter.py::run_engine", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode < "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("nodes/comfy_adapter.py::run_engine", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode <= "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("nodes/comfy_adapter.py::run_engine", 'tier = "auto" if settings.mode == "auto" else settings.mode',
     'tier = "auto" if settings.mode is "auto" else settings.mode',
     "the original is just tier = settings.mode; every mode sorts at or after \"auto\" and is an interned "
     "literal, so the mutated test is true only for \"auto\" (or never) and tier is still settings.mode"),
    ("attention_core/kernel/tiles.py::TileSource.scores",
     "if p.causal and j1 - 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "if p.causal and j1 - 1 > i0 | p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "i0 >= 0, so i0 | offset = i0 + offset - (i0 & offset) <= i0 + offset: the test only widens, and the causal "
     "masked_fill it lets through more often is a no-op there"),
    ("attention_core/ffn/chunking.py::chunk_count",
     "return max(1, min(n, math.ceil(act_bytes / max(1, free * AUTO_SHARE))))",
     "return max(1, min(n, math.ceil(act_bytes / max( 0, free * AUTO_SHARE))))",
     "free is at least 1 byte (0 is replaced by 4 GiB) and AUTO_SHARE > 0, so the floor of the divisor only "
     "matters below 1 byte, where both give n chunks"),
    ("attention_core/kernel/tiles.py::TileSource.scores",
     "if p.causal and j1 - 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "if p.causal and j1 // 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal",
     "the test only skips a no-op: with j1 - 1 == i0 + offset no key is right of any row's diagonal"),
    ("attention_core/parallel/group.py::_agree", "meta += [0.0] * (_META - len(meta))", "meta += [0.0] * (_META + len(meta))",
     "only more zero padding, which meta[:_META] cuts off on the next line"),
    ("attention_core/ffn/exactness.py::_close",
     "if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \\",
     "if not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)) or a.shape != b.shape \\",
     "_close's only caller (exactness.check) passes two tensors or b = None; with None the mutant raises "
     "AttributeError, which check catches and answers False, as the original does"),
    ("attention_core/kernel/problem.py::normalize",
     "seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())",
     "seed = int(torch.randint( -1, 2 ** 62, (1,), dtype=torch.int64).item())",
     "a seed of -1 (one draw in 2**62) is as good a seed for the xor-multiply hash as any other"),
    ("attention_core/kernel/tiles.py::TileSource.scores",
     "kt = k[:, :, j0:j1].transpose(-1, -2)", "kt = k[:, :, j0:j1].transpose(-1, 2)",
     "k is always 4-D (B, Hkv, Lk, E), so dim 2 is dim -2"),
    ("attention_core/parallel/flash_layout.py::flash_layout_attention",
     "if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:",
     "if tuple(window_size) > (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:",
     "flash-attn window sizes are -1 (unbounded) or >= 0, and every such pair other than (-1, -1) compares "
     "greater than it"),
    ("attention_core/kernel/memory.py::bytes_per_score", "if p.dropout_p > 0:", "if p.dropout_p != 0:",
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
    shortcut too, but it is not listed (not examined by hand): those mutants are judged by their run."""
    line = "if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:"
    why = ("the term is a shortcut: for this empty dimension the tiers give the same empty output and zero "
           "gradients without it (sizes are never negative)")
    terms = ["Lq", "B", "Hkv", "G"]
    out = []
    for scope in ("forward_canonical", "backward_canonical"):
        key = f"attention_core/kernel/ops.py::{scope}"
        out += [(key, line, line.replace(f"p.{t} == 0", f"p.{t} {op}"), why)
                for t in terms for op in ("< 0", "<= 0", "== -1")]
        out += [(key, line, line.replace(f"p.{a} == 0 or p.{b} == 0", f"p.{a} == 0 and p.{b} == 0"), why)
                for a, b in zip(terms, terms[1:])]
    return out


EQUIVALENT += _empty_guard_equivalents()
# a device name from cli_args.device (cleaned) or default_device(), compared with "cpu"
_CLEANED_DEVICE = ("the device is cli_args.device's cleaned name or default_device()'s: \"cpu\", \"cuda\" or "
                   "\"cuda:N\", and every \"cuda...\" sorts after \"cpu\" (u > p), so <= \"cpu\" holds for \"cpu\" "
                   "alone, as == does")
EQUIVALENT += [
    ("attention_core/cli/bench_models/__init__.py::main",
     'a.dtype = a.dtype or ("float32" if a.device == "cpu" else "float16")',
     'a.dtype = a.dtype or ("float32" if a.device <= "cpu" else "float16")',
     _CLEANED_DEVICE),
    ("attention_core/cli/tune.py::main",
     'dtypes = [d.strip() for d in (a.dtype or ("float32" if device == "cpu" else "float16")).split(",")]',
     'dtypes = [d.strip() for d in (a.dtype or ("float32" if device <= "cpu" else "float16")).split(",")]',
     _CLEANED_DEVICE),
    ("attention_core/device/tile_bytes.py::tile_bytes_per_score", "return ss + cast", "return ss | cast",
     "ss is 4 where cast is 2 (an fp16 tile the guard scores in fp32) and cast is 0 otherwise: 4 and 2 share no bit, "
     "and x | 0 is x, so | is + for every pair the two lines before can give"),
    ("attention_core/ffn/exactness.py::_pieces_q", "return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]",
     "return [b - a for a, b in zip(bounds, bounds[1:]) if b != a]",
     "bounds is 0, then the sorted distinct cuts strictly between 0 and n, then n: it never decreases, so b != a "
     "is b > a"),
    ("nodes/comfy_adapter.py::PatchSettings", "min_tokens: int = 0", "min_tokens: int = -1",
     "min_tokens is read only as max(lq, lk) < min_tokens, and sequence lengths are never negative: 0 and -1 both "
     "let every call through (the nodes always pass their own, >= 0 by their schema)"),
    ("nodes/comfy_adapter.py::_seq_lens", 'return call["q"].shape[-2], call["k"].shape[-2]',
     'return call["q"].shape[+2], call["k"].shape[-2]',
     "with skip_reshape ComfyUI hands q as (batch, heads, tokens, head dim), always 4-D (its attention functions "
     "unpack b, _, _, dim_head = q.shape): index 2 is index -2"),
    ("attention_core/kernel/tiers/backward.py::backward",
     "dv[:, :, j0:j1] += matmul(pd.view(B, H, rows, bk).transpose(-1, -2).to(cd), dot).to(st)",
     "dv[:, :, j0:j1] += matmul(pd.view(B, H, rows, bk).transpose(-1, 2).to(cd), dot).to(st)",
     "the view is 4-D (B, H, rows, bk): dim 2 is dim -2"),
    ("attention_core/kernel/tiers/backward.py::backward",
     "s = src.scores(qt, i0, i1, j0, j1, slot=0 if qt.dtype == st else None).to(st)",
     "s = src.scores(qt, i0, i1, j0, j1, slot= -1 if qt.dtype == st else None).to(st)",
     "a scratch slot is only a key of TileSource's buffer table: the backward uses two (the scores, dP in slot 1), "
     "and -1 is as distinct from 1 as 0 is, so the same two buffers are reused tile to tile"),
    ("attention_core/kernel/tiers/backward.py::_accumulate_mask_grad",
     "dims = tuple(d for d in range(5) if dmask.shape[d] == 1 and ds.shape[d] != 1)",
     "dims = tuple(d for d in range(5) if dmask.shape[d] == 1 and ds.shape[d] > 1)",
     "ds is one tile's (B, H, G, rows, keys): the tile loop runs only for non-empty problems (ops.py's empty "
     "guard answers those first; checked with a mask needing grad on torch 2.5.1 and 2.14.1, every tier), so no "
     "dim of ds is 0 and != 1 is > 1"),
    ("nodes/override_notice.py::custom_node_folder",
     "if path.startswith(f + os.sep) and (best is None or len(f) > best[0]):",
     "if path.startswith(f + os.sep) and (best is None or len(f) >= best[0]):",
     "a tie needs two different folders of the same length that both begin the path, which is one string: they "
     "are the same folder, and a folder's entry is keyed by its own name, so best names the same pack either way"),
    ("nodes/override_notice.py::check", "if current is expected:", "if current == expected:",
     "expected is the plain function make_override returned: functions compare by identity, and no override "
     "object (ComfyUI's closures, the packs') defines an __eq__ that claims equality with another function"),
    ("nodes/clones.py::rebind_object_patches", "if clone.model is original.model:",
     "if clone.model == original.model:",
     "the models are torch.nn.Modules, which define no __eq__: == is identity for them"),
    ("nodes/object_routes.py::leaf_modules_with_parameter",
     'return sorted(name for name in takes if not any(o != name and (name == "" or o.startswith(name + "."))',
     'return sorted(name for name in takes if not any(o != name and (name is "" or o.startswith(name + "."))',
     "CPython keeps one empty str object: a name equal to \"\" is that object, so `is \"\"` is `== \"\"`"),
    ("nodes/vae_route.py::VaeAttentionRoute.__call__", "return out.transpose(2, 3).reshape(shape)",
     "return out.transpose( 1, 3).reshape(shape)",
     "out is [b, 1, n, c]: dim 1 has size 1, so transposing 1 and 3 or 2 and 3 orders the elements the same "
     "(b, c, n) and the reshape gives the same tensor"),
    ("nodes/comfy_adapter.py::count", "return 0", "return -1",
     "the one caller that reads count()'s result compares it with 1 (the first-call log, run_engine's caller); "
     "inside a trace 0 and -1 both differ from 1"),
    ("nodes/everywhere.py::_describe",
     'where = "where this device needs it" if s["mode"] == "auto" else f"on every device, tier {s[\'mode\']}"',
     'where = "where this device needs it" if s["mode"] <= "auto" else f"on every device, tier {s[\'mode\']}"',
     'this branch runs with the mode on: s["mode"] is one of "auto", "chunked", "online", "inplace" (set_mode '
     'checks), none of which sorts before "auto", so `<= "auto"` holds for "auto" alone, like `==`'),
    ("attention_core/parallel/blocks.py::block_backward", "gqa = q.shape[1] != k.shape[1]",
     "gqa = q.shape[1] is not k.shape[1]",
     "head counts that differ are never the same object, so the mutant is True whenever the original is; it is "
     "also True for equal counts above 256 (ints CPython does not cache), and enable_gqa with as many kv heads as "
     "query heads is the plain problem (group size 1: normalize gives G = 1, the same tiles and sums)"),
    ("attention_core/cli/plan.py::<module>", '"wan22-5b-4096": (None, 0, 0, 0, [4096], 24, 128),',
     '"wan22-5b-4096": (None, 0, 1, 0, [4096], 24, 128),',
     "a preset without a model gives its token counts directly (the list); preset_shapes never reads its width, "
     "height or frames"),
    ("nodes/comfy_adapter.py::wants_engine", 'if settings.mode == "auto":', 'if settings.mode <= "auto":',
     'settings.mode is one of MODES ("auto", "chunked", "online", "inplace"; "off" returned above), checked by '
     'make_settings: none sorts before "auto", so `<= "auto"` holds for "auto" alone, like `==`'),
    ("nodes/clones.py::rebind_object_patches", "if new is not patch:", "if new != patch:",
     "_rebound returns `patch` itself or a new wrapper object or bound method; none of this pack's wrappers "
     "defines __eq__ (identity), and a method bound to another module's object never equals one bound to the "
     "original: `!=` is `is not` for every value it can see"),
    ("nodes/comfy_adapter.py::_seq_lens", 'return call["q"].shape[-2], call["k"].shape[-2]',
     'return call["q"].shape[2], call["k"].shape[-2]',
     "with skip_reshape ComfyUI's callers hand q as [B, H, N, D] (its own attention functions unpack four dims "
     "from it), where axes -2 and 2 are the same"),
    ("nodes/object_routes.py::leaf_modules_with_parameter",
     'return sorted(name for name in takes if not any(o != name and (name == "" or o.startswith(name + "."))',
     'return sorted(name for name in takes if not any(o != name and (name <= "" or o.startswith(name + "."))',
     "names are strings and no string sorts before the empty one: `name <= \"\"` holds for \"\" alone, as `==`"),
    ("nodes/fit.py::AttentionFit.execute",
     'est = plan.estimate(model, width, height, frames, free, 4 if dtype == "fp32" else 2, cpu=device == "cpu",',
     'est = plan.estimate(model, width, height, frames, free, 4 if dtype == "fp32" else 2, cpu=device <= "cpu",',
     'device is str(torch.device) of ComfyUI\'s device: "cpu" or a type name that sorts after it ("cuda:0", '
     '"mps", "xpu:0", "privateuseone:0", ...: no torch device type sorts before "cpu"), so `<= "cpu"` holds for '
     '"cpu" alone, like `==`'),
    ("nodes/fit.py::AttentionFit.execute",
     'est = plan.estimate(model, width, height, frames, free, 4 if dtype == "fp32" else 2, cpu=device == "cpu",',
     'est = plan.estimate(model, width, height, frames, free, 4 if dtype >= "fp32" else 2, cpu=device == "cpu",',
     'dtype is the Combo\'s "fp16", "bf16" or "fp32" (ComfyUI refuses any other value): "fp16" and "bf16" sort '
     'before "fp32", so `>= "fp32"` is true for "fp32" alone, like `==`'),
    ("nodes/comfy_adapter.py::run_engine",
     'if call["attn_precision"] == torch.float32 or (kwargs.get("low_precision_attention") is False',
     'if call["attn_precision"] == torch.float32 or (kwargs.get("low_precision_attention") == False',
     "ComfyUI's models pass low_precision_attention only as the literal False (or leave it out: None); for "
     "False, True and None `== False` and `is False` agree. Only a non-bool (0, numpy.False_) would tell them "
     "apart, and no caller passes one"),
    ("attention_core/ffn/chunking.py::run_pieces",
     "if not isinstance(y, torch.Tensor) or y.dim() != x.dim() or y.shape[dim] != size:",
     "if not isinstance(y, torch.Tensor) or y.dim() is not x.dim() or y.shape[dim] != size:",
     "tensor ranks are small ints, which CPython caches: `is not` is `!=` for them (piece lengths are not: "
     "`is not` on y.shape[dim] is killed by test_pieces_longer_than_256_tokens_are_chunked_exactly)"),
    ("attention_core/kernel/autograd.py::_bwd_vmap", "if in_dims[9] is not None:", "if in_dims[ 10] is not None:",
     "the backward's seed is the one the forward saved: a vmapped seed is refused by the forward rule "
     "(test_dropout_under_vmap_with_different_randomness_names_the_seed), so no public call reaches the backward "
     "rule with one; only a direct vmap of the tiled_attention::bwd op would"),
    ("attention_core/cli/estimate.py::layer_flops", '"ffn": 2 * 2.0 * n * c * f,',
     '"ffn": 2 ** 2.0 * n * c * f,',
     "2 * 2.0 and 2 ** 2.0 are both 4.0 (two matmul FLOPs a multiply-add, times 2 projections or GEMMs)"),
    ("attention_core/cli/estimate.py::layer_flops", '"self_attn": 2 * 2.0 * n * n * c,',
     '"self_attn": 2 ** 2.0 * n * n * c,',
     "2 * 2.0 and 2 ** 2.0 are both 4.0 (two matmul FLOPs a multiply-add, times 2 projections or GEMMs)"),
    ("attention_core/cli/estimate.py::layer_flops", '"cross_attn": 2 * 2.0 * n * text * c,',
     '"cross_attn": 2 ** 2.0 * n * text * c,',
     "2 * 2.0 and 2 ** 2.0 are both 4.0 (two matmul FLOPs a multiply-add, times 2 projections or GEMMs)"),
    ("attention_core/cli/estimate.py::layer_flops", '"cross_proj": 2 * 2.0 * n * c * c + 2 * 2.0 * text * c * c,',
     '"cross_proj": 2 ** 2.0 * n * c * c + 2 * 2.0 * text * c * c,',
     "2 * 2.0 and 2 ** 2.0 are both 4.0 (two matmul FLOPs a multiply-add, times 2 projections or GEMMs)"),
    ("attention_core/cli/estimate.py::layer_flops", '"cross_proj": 2 * 2.0 * n * c * c + 2 * 2.0 * text * c * c,',
     '"cross_proj": 2 * 2.0 * n * c * c + 2 ** 2.0 * text * c * c,',
     "2 * 2.0 and 2 ** 2.0 are both 4.0 (two matmul FLOPs a multiply-add, times 2 projections or GEMMs)"),
    ("attention_core/parallel/blocks.py::block_forward",
     "enable_gqa=q.shape[1] != k.shape[1], **engine_kwargs)",
     "enable_gqa=q.shape[1] > k.shape[1], **engine_kwargs)",
     "only the ring calls it, after _agreed refused q heads that are not a multiple of the kv heads and "
     "ring_attention returned for zero query heads: every call has H >= Hkv >= 1, where `>` is `!=`"),
    ("attention_core/kernel/tangents.py::attention_jvp",
     "dropout_seed=0, out_shape=(), squeeze_2d=False).head_index()",
     "dropout_seed=1, out_shape=(), squeeze_2d=False).head_index()",
     "this AttentionProblem is built only for head_index(), which reads B, Hkv, G, heads_total and head_offset, "
     "never the seed (the seed the dropout uses is seed_int, read from the op's seed tensor below)"),
    ("attention_core/parallel/ulysses.py::ulysses_attention",
     "rep = rep if g % rep == 0 else g", "rep = rep if g % rep <= 0 else g",
     "g % rep is never negative"),
    ("attention_core/parallel/ulysses.py::ulysses_attention",
     "rep = rep if g % rep == 0 else g", "rep = rep if g % rep >= 0 else g",
     "the else is unreachable: P divides H = Hkv * g, so rep = P // gcd(Hkv, P) divides g"),
] + [("attention_core/parallel/ulysses.py::ulysses_attention", "g = H // Hkv", f"g = H {op} Hkv",
       "g only decides `rep if g % rep == 0 else g`, and only H >= 1 query heads over Hkv >= 1 kv heads with "
       "Hkv | H reach this line (zero heads return torch's empty result before it, zero kv heads are a ValueError "
       "of the agreement: issue 22.8). The true g = H / Hkv is a multiple of rep = P // gcd(Hkv, P) (P | H = Hkv "
       "g), and so is each mutant: H / Hkv as a float, H % Hkv = 0, H * Hkv, H ** Hkv and H << Hkv are multiples "
       "of H or 0, so the test stays true and rep is the same") for op in ("/", "%", "*", "**", "<<")
    # `*`, `**`, `<<` were not listed while zero kv heads reached this line (// raised there, they gave a number)
] + [("attention_core/parallel/ulysses.py::ulysses_attention",
      "if Hkv % P:  # fewest kv-head copies so that kv heads split with their query heads",
      f"if Hkv {op} P:  # fewest kv-head copies so that kv heads split with their query heads",
      "the test only skips a no-op: with P | Hkv, rep = P // gcd(Hkv, P) = 1 and _repeat_kv returns k itself; the "
      "mutated test is true whenever Hkv % P is (Hkv >= 1, P >= 2)") for op in ("+", "-", "*", "/", "**", "<<", "|", "^")
] + [("attention_core/cli/estimate.py::_interp", "if n <= pts[0][0]:", "if n < pts[0][0]:",
       "at n equal to the first count the loop's first pair gives t = 0.0 and r0 ** 1.0 * r1 ** 0.0 == r0 exactly; "
       "a single point falls through to the `>=` branch with the same rate"),
      ("attention_core/cli/estimate.py::_interp", "if n >= pts[-1][0]:", "if n > pts[-1][0]:",
       "at n equal to the last count the last pair gives t == 1.0 and r0 ** 0.0 * r1 ** 1.0 == r1 exactly"),
      ("attention_core/cli/calibrate.py::measure",
       "g = torch.Generator().manual_seed(0)", "g = torch.Generator().manual_seed( 1)",
       "the seeded inputs are noise timed for speed only: no stored value depends on them"),
      ("attention_core/cli/calibrate.py::measure",
       "g = torch.Generator().manual_seed(0)", "g = torch.Generator().manual_seed( -1)",
       "the seeded inputs are noise timed for speed only: no stored value depends on them"),
] + [("attention_core/cli/estimate.py::report", "f\"{st.cfg_batch * batch}{' (CFG)' if st.cfg_batch == 2 else ''}\")",
      f"f\"{{st.cfg_batch * batch}}{{' (CFG)' if st.cfg_batch {op} else ''}}\")",
      "Stage.cfg_batch is 1 or 2 in every stage of STAGES (small ints are cached, so `is` is `==`)")
     for op in (">= 2", "> 1", "is 2")
] + [("attention_core/cli/estimate.py::_interp#2", "return pts[-1][1]", f"return pts[{i}][1]",
      "unreachable at the end of _interp: n strictly between the first and last counts lies in some pair; only "
      "a NaN token count falls through, and no caller passes one (step_time takes the int from plan.tokens). "
      "Not the first `return pts[-1][1]` of _interp (n at or above the last count), whose mutants are killed")
     for i in ("-2", "- 1", "+1", "1", "0", "~1")
] + [("attention_core/cli/cli_args.py::int_range", "def int_range(lo: int = 1, hi: int | None = None):",
       f"def int_range(lo: int = 1, hi: int {op} None = None):",
       "with `from __future__ import annotations` annotations are strings, never evaluated")
      for op in ("<<", ">>", "&", "^", "+", "-", "*", "/", "//", "%", "**")
] + [("attention_core/cli/tune.py::candidates", 'if bkv > n and tier == "online":',
      f'if bkv > n and tier {op} "online":',
      "for chunked and inplace the only key block is n, so `bkv > n` is already False; for online both agree")
     for op in ("<=", ">=")
] + [(f"attention_core/cli/tune.py::{scope}", "g = torch.Generator().manual_seed(0)",
       f"g = torch.Generator().manual_seed({x})",
       "tune_shape's and layout_check's seeded inputs are noise timed for speed only (the layout check's "
       "exactness figure is printed, not kept, and holds for any inputs)")
      for scope in ("tune_shape", "layout_check") for x in (" 1", " -1")
] + [("attention_core/cli/plan.py::comfy_split",
       "steps = 1 if need <= free else 2 ** math.ceil(math.log2(need / free))",
       "steps = 1 if need < free else 2 ** math.ceil(math.log2(need / free))",
       "at need == free the else branch gives 2 ** ceil(log2(1.0)) = 1, the same count"),
      ("attention_core/cli/plan.py::kv_copy_bytes",
       'copied = layout == "comfyui" or compute != dtype or (batch > 1 and not all_heads)',
       'copied = layout == "comfyui" or compute > dtype or (batch > 1 and not all_heads)',
       "compute_dtype changes a dtype only fp16 -> fp32, bf16 -> fp32 or bf16 -> fp16, and each compares greater "
       "as a string (\"fp32\" > \"fp16\" > \"bf16\")"),
      ("attention_core/cli/plan.py::report",
       'note = "" if sp["rows"] != n or sp["steps"] == 1 else f"; N does not divide by {sp[\'steps\']}: no slicing"',
       'note = "" if sp["rows"] != n or sp["steps"] <= 1 else f"; N does not divide by {sp[\'steps\']}: no slicing"',
       "the slice count is 1 or a power of two, never below 1"),
      ("attention_core/cli/plan.py::ffn_auto_chunks",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "return max( 0, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "min(n, ceil of a positive number) is already at least 1 (n >= 1)"),
      ("attention_core/cli/plan.py::ffn_auto_chunks",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))",
       "return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max( 2, free * AUTO_SHARE))))",
       "the feed-forward bytes are at least 2 N, so a divisor up to 2 still gives >= N chunks, capped at N"),
] + [("attention_core/multidevice.py::_mask_for",
       "if mask.dim() >= 3 and mask.shape[-3] == q_heads and q_heads > 1:",
       f"if mask.dim() >= 3 and mask.shape[-3] == q_heads and q_heads {op}:",
       "with one query head there is one group, and its slice [..., 0:1, :, :] of a mask whose head dim is 1 is "
       "the whole mask") for op in (">= 1", "> 0")
] + [("attention_core/parallel/group.py::<module>", "_META = 40", f"_META = {x}",
      "the description has 30 entries and every rank pads to the same length: only zero padding changes")
     for x in ("41", "39")
] + [("attention_core/parallel/group.py::_describe", "code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 9",
      f"code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else {x}",
      "any code from 5 up prints as \"other\" and equals no listed dtype's code; every rank computes the same")
     for x in ("10", "8")
] + [("attention_core/device/detection.py::_fused_ops",
       '"efficient": lambda q: aten._scaled_dot_product_efficient_attention(q, q, q, None, False)[0]}',
       '"efficient": lambda q: aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[0]}',
       "the probe only asks whether the kernel runs; compute_log_sumexp adds an output and [0] is the attention "
       "output either way (GPU-only code)")
] + [("attention_core/patch.py::<module>", "OFF = Config(False, 0, {})", f"OFF = Config({m})",
       "OFF is the Config of a State that is not installed (at import, and when _refresh removes the patch); "
       "_patched_sdpa and config() never use a State's Config unless it is installed, and _refresh compares OFF "
       "only with itself, so its force and min_tokens are never read") for m in ("True, 0, {}", "False, 1, {}",
                                                                              "False, -1, {}")
] + [("attention_core/cli/estimate.py::_interp", "if n0 <= n <= n1:", f"if n0 {op} n <= n1:",
       "n lies strictly inside the (distinct, sorted) measured token counts here, so the first pair with n <= n1 "
       "has n0 < n: the left test is true in the original and the mutant alike") for op in ("!=", "<", "is not")
] + [("attention_core/cli/estimate.py::_interp", "if n0 <= n <= n1:", "if n0 <= n < n1:",
       "when n equals a measured count n1 the lookup moves on to the next pair, whose n0 is n: t = 0 there and "
       "r0 ** 1.0 * r1 ** 0.0 is that same measured rate, bit for bit (the last count returns before the loop)")
] + [("attention_core/cli/plan.py::<module>", f'"{name}": ("{model}", 832, 480, {f}, None, {h}, 128),',
       f'"{name}": ("{model}", {w}, 480, {f}, None, {h}, 128),',
       "a preset's width only feeds plan.tokens (preset_shapes; never printed): the VAE's W // 16 (Wan 2.2 5B) or "
       "W // 8 (Wan 2.1 14B), rounded up to whole 2-wide patches, gives the same token count for 831, 832 and "
       "833 (4290 and 32760 tokens)")
      for name, model, f, h in (("wan22-5b-480p", "wan22-5b", 41, 24), ("wan-14b-480p", "wan-14b", 81, 40))
      for w in (831, 833)
] + [("attention_core/parallel/ulysses.py::ulysses_attention",
      before, before.replace("mask.shape[2] > 1", "mask.shape[2] != 1"),
      "mask.shape[2] is 1 or n (_mask4 checks it), so `!= 1` differs from `> 1` only with n = 0 query rows, where "
      "every tensor is empty: sending the empty mask through the all-to-all or the row gather gives the same empty "
      "mask, output and gradients (run on 2 gloo ranks: 0-row masks of [1, H, 0, 0], [1, 1, 0, 0], [H, 0, 0], "
      "[0, 0], with and without gradients, MHA and GQA, identical to the original)")
     for before in ("if mask.shape[1] > 1 and (mask.shape[2] > 1 or grad):",
                    "if mask.shape[2] > 1 or grad:  # rows without heads: every rank needs all rows")
] + [
    ("attention_core/cli/plan.py::estimate",
     "copies = kv_copy_bytes(batch, h, n, spec.head_dim, dtype, compute, layout, h >= spec.heads)",
     "copies = kv_copy_bytes(batch, h, n, spec.head_dim, dtype, compute, layout, h == spec.heads)",
     "h is the tile's head count from memory.tile_for over spec.heads kv heads, which is between 1 and "
     "spec.heads: h >= spec.heads is h == spec.heads"),
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
    outcome: str = "pending"  # pending | killed | survived | timeout | incompetent | equivalent
    seconds: float = 0.0
    why: str = ""
    output: str = ""  # the first failing test of a killed mutant
    by_new_tests: bool = False  # killed, but only by the tests in NEW_KILL_TESTS
    scope: Optional[str] = None  # qualified name of the def/class around the changed line ("<module>" outside)
    nth: int = 1  # which line of that text in that scope (1 = the first)

    def key(self):
        return self.path, self.before.strip(), self.after.strip()


# ------------------------------------------------------------------------------------------------------------
# where a line is: EQUIVALENT's keys


def parse_key(key: str):
    """"path::Scope.name#n" -> (path, scope, n); "#n" optional (default 1); ValueError when malformed."""
    m = re.fullmatch(r"([\w./-]+\.py)::([\w.<>]+)(?:#([1-9][0-9]*))?", key)
    if not m:
        raise ValueError(f"an EQUIVALENT key must read 'path/to/file.py::Scope.name' or '...::Scope.name#n', "
                         f"got {key!r}")
    return m.group(1), m.group(2), int(m.group(3) or 1)


def line_scopes(source: str) -> list:
    """The scope of each line (index 0 = line 1): the dotted qualified name of the innermost def or class that
    holds it (decorators included), "<module>" outside any."""
    import ast
    lines = source.split("\n")
    out = ["<module>"] * len(lines)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                for ln in range(first, (child.end_lineno or child.lineno) + 1):
                    out[ln - 1] = name
                walk(child, name + ".")
            else:
                walk(child, prefix)
    walk(ast.parse(source), "")
    return out


def locate(source: str, line: int, scopes=None):
    """(scope, n) of line `line` (1-based): its scope and which line of the same stripped text in that scope it
    is (1 = the first, in source order)."""
    lines = source.split("\n")
    scopes = scopes or line_scopes(source)
    text, scope = lines[line - 1].strip(), scopes[line - 1]
    n = sum(1 for i in range(line) if scopes[i] == scope and lines[i].strip() == text)
    return scope, n


def _anchor(before: str) -> str:
    """The original line an entry names (a whole-statement change is keyed on its diff body: the first - line)."""
    if before.startswith("-"):
        return before.split(" | ")[0][1:].strip()
    return before.strip()


def equivalent_reason(m: Mutant):
    """The reason EQUIVALENT gives for this mutant: same file, same scope, the same one of the identical lines
    there, same original and mutated text. None when it is not listed (or the mutant was never located)."""
    if m.scope is None:
        return None
    for key, before, after, why in EQUIVALENT:
        path, scope, nth = parse_key(key)
        if (path, scope, nth) == (m.path, m.scope, m.nth) and (before.strip(), after.strip()) == m.key()[1:]:
            return why
    return None


def stale_equivalents(tree: Optional[Path] = None, entries=None) -> list:
    """Messages for the EQUIVALENT entries that name nothing in the tree at `tree`: a malformed key, a file that
    is gone, no n-th line of that text in that scope (the code changed: examine the mutant again), an entry whose
    mutated line is the original, or an entry listed twice."""
    tree = tree or ROOT
    out, seen, cache = [], set(), {}
    for key, before, after, _why in (EQUIVALENT if entries is None else entries):
        name = f"{key} `{before.strip()}` -> `{after.strip()}`"
        try:
            path, scope, nth = parse_key(key)
        except ValueError as e:
            out.append(f"{name}: {e}")
            continue
        if (path, scope, nth, before.strip(), after.strip()) in seen:
            out.append(f"{name}: listed twice")
        seen.add((path, scope, nth, before.strip(), after.strip()))
        if before.strip() == after.strip():
            out.append(f"{name}: the mutated line is the original")
        if path not in cache:
            f = tree / path
            source = f.read_text(encoding="utf-8") if f.is_file() else None
            cache[path] = (source.split("\n"), line_scopes(source)) if source is not None else None
        if cache[path] is None:
            out.append(f"{name}: {path} does not exist")
            continue
        lines, scopes = cache[path]
        found = sum(1 for ln, sc in zip(lines, scopes) if sc == scope and ln.strip() == _anchor(before))
        if found < nth:
            where = "no such line" if not found else f"only {found} such line(s)"
            out.append(f"{name}: {where} in {scope} of {path} (stale: the code changed; examine the mutant again "
                       f"and key the entry to where the line is now, or drop it)")
    return out


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
    m.scope, m.nth = locate(source, m.line)
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
    """The module's files in the mutated tree (the layout differs between revisions), less those not mutated
    (not_mutated)."""
    files = set()
    for pattern in MODULES[module]["files"]:
        files.update(str(f.relative_to(tree)) for f in tree.glob(pattern) if f.is_file())
    return sorted(f for f in files if not not_mutated(f, tree))


def not_mutated(path: str, tree: Path) -> bool:
    """The benchmark CLI (timings and a table, not engine behaviour): attention_core/bench.py, and since the
    commands moved into attention_core/cli/, its parts cli/bench.py and cli/bench_*.py (not cli/bench_models/);
    and the commands' one-line aliases, attention_core/<name>.py where cli/<name>.py holds the code."""
    if path == "attention_core/bench.py" or re.fullmatch(r"attention_core/cli/bench(_\w+)?\.py", path):
        return True
    folder, _, name = path.rpartition("/")
    return folder == "attention_core" and (tree / "attention_core" / "cli" / name).is_file()


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


def all_tests(module: str, tree: Path, paths=None):
    """The union of the selections of `paths` (default: every file of the module): what the coverage run runs.
    Given the sampled mutants' files, it runs only what those mutants can need."""
    files = set()
    for rel in sorted(set(paths)) if paths is not None else module_files(module, tree):
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
    shutil.copy(ROOT / "tools" / "mutation" / "mutate_coverage.py", plugin_dir / "mutate_coverage_plugin.py")
    env = dict(os.environ, MUTATE_COVERAGE_FILE=str(data_file), MUTATE_TREE=str(tree),
               PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd + ["-rf", "-p", "mutate_coverage_plugin"], cwd=tree, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"mutate: the {module} coverage run ({len(tests)} test files) passed its limit of "
                         f"{timeout:.0f}s; no mutant was run (a smaller --sample, --file or --tests covers less)")
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


def import_time_lines(source: str) -> set:
    """Line numbers (1-based) that run when the module is imported: every line outside a function's body (module
    and class statements, decorators, def headers with their defaults). Coverage credits them to whichever test
    happened to import the module first, so that test alone says nothing about who reads them."""
    import ast
    inside = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            inside.update(range(node.body[0].lineno, (node.end_lineno or node.body[-1].lineno) + 1))
    return set(range(1, source.count("\n") + 2)) - inside


def covering_tests(m: "Mutant", lines: dict, deselect=(), import_time=frozenset()):
    """Node ids (relative to tests/) of the tests that run the mutated line; [""] if only imports run it. A line in
    `import_time` (import_time_lines of its file) is run by every test that runs any line of the file."""
    per_line = lines.get(m.path, {})
    ids = set()
    for ln in {m.start_line, m.line}:
        ids |= per_line.get(ln, set())
    if ids and {m.start_line, m.line} & set(import_time):
        for covered in per_line.values():
            ids |= covered
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


def counts(ms) -> dict:
    k, s, t, e, pct = score(ms)
    return {"sampled": len(ms), "killed": k, "survived": s, "timeout": t, "equivalent": e,
            "incompetent": sum(m.outcome == "incompetent" for m in ms),
            "pending": sum(m.outcome == "pending" for m in ms), "score": round(pct, 1)}


def choose_seed(given: Optional[int], entropy: Optional[bytes] = None, now: Optional[float] = None) -> dict:
    """The sample's seed: `given` (--seed: a repeat, not a fresh sample), else a fresh one from os.urandom, with the
    time it was drawn and the commit whose tests it scores (+ "with uncommitted changes" for a dirty tree)."""
    fresh = given is None
    seed = int.from_bytes(entropy or os.urandom(4), "big") % 1_000_000 if fresh else given
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now if now is not None else time.time()))
    return {"seed": seed, "fresh": fresh, "drawn_at": when if fresh else None, "commit": _commit()}


def _commit(ref: Optional[str] = None) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", f"{ref or 'HEAD'}^{{commit}}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = "" if ref else subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
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
    pending = sum(m.outcome == "pending" for m in ms)
    partial = f"; INCOMPLETE: {pending} of {len(ms)} mutants not run" if pending else ""
    return (f"{module}: {kind}: {k} killed / {k + s + t} ({s} survived, {t} timeout) = {pct:.1f}% "
            f"({verdict} the {TARGET:.0f}% target); {e} equivalent listed separately; {seed}{partial}")


def report(results: dict, totals: dict, deselected: dict, args, out=None, meta: Optional[dict] = None,
           rescored: bool = False):
    w = (out or sys.stdout).write
    meta = meta or {"seed": args.seed, "fresh": False, "commit": "unknown"}
    w(f"\n# Mutation testing (cosmic-ray; {'fresh ' if meta.get('fresh') else ''}seed {meta.get('seed')}, "
      f"sample {meta.get('sample', args.sample) or 'all'} per module)\n\n")
    if meta.get("complete") is False:
        w(f"**Partial report: the run {meta.get('stopped') or 'has not finished'}; mutants not run are pending and "
          f"not scored.**\n\n")
    for module, ms in results.items():
        w(f"**{headline(module, ms, meta, rescored)}**\n\n")
    w("| module | mutants | sampled | killed | survived | timeout | equivalent | pending | score | "
      "without the kill tests |\n")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for module, ms in results.items():
        k, s, t, e, pct = score(ms)
        new = sum(m.by_new_tests for m in ms)
        old = 100.0 * (k - new) / (k + s + t) if k + s + t else 100.0
        pending = sum(m.outcome == "pending" for m in ms)
        w(f"| {module} | {totals.get(module, '?')} | {len(ms)} | {k} | {s} | {t} | {e} | {pending} | {pct:.1f}% | "
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


def _write_atomically(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_progress(json_path: Path, report_path: Path, results: dict, meta: dict, args):
    """The run so far: every sampled mutant with its outcome (pending until run) as JSON (--rescore reads it) and
    the markdown report. Called after each mutant, so a crash or a kill leaves a partial report."""
    totals, deselected = meta.get("totals", {}), meta.get("deselected", {})
    _write_atomically(json_path, json.dumps(
        {"_meta": meta, **{mod: [dataclasses.asdict(m) for m in ms] for mod, ms in results.items()}}, indent=1))
    out = io.StringIO()
    report(results, totals, deselected, args, out=out, meta=meta)
    _write_atomically(report_path, out.getvalue())


# ------------------------------------------------------------------------------------------------------------
# the draws log: every fresh draw, whatever it scored


def draw_entries(results: dict, meta: dict, args) -> list:
    """One log line per module of a fresh draw: seed, commit, date, counts, and the options that narrowed it."""
    filters = {k: v for k, v in (("file", args.file), ("operator", args.operator), ("tests", args.tests),
                                 ("ref", args.ref), ("deselect", args.deselect),
                                 ("skip_baseline", args.skip_baseline)) if v}
    return [{"module": mod, "seed": meta["seed"], "drawn_at": meta.get("drawn_at"), "commit": meta.get("commit"),
             "ended_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sample": meta.get("sample"),
             "mutants": meta.get("totals", {}).get(mod), **counts(ms), "complete": bool(meta.get("complete")),
             "whole_module": not any(k in filters for k in ("file", "operator", "tests")), "filters": filters,
             "report": str(meta.get("json", ""))}
            for mod, ms in results.items()]


def append_draws(entries: list, path: Path = None):
    """Append to the draws log (DRAWS_LOG, in the real working tree, not the copy the mutants run in)."""
    path = path or DRAWS_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, sort_keys=True) + "\n")


def read_draws(path: Path = None) -> list:
    path = path or DRAWS_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def latest_draw(entries: list, module: str) -> Optional[dict]:
    """The module's latest whole-module draw (the last in the log, whatever it scored; --file/--operator/--tests
    draws are logged but scope only part of it)."""
    module = ALIASES.get(module, module)
    return next((e for e in reversed(entries)
                 if ALIASES.get(e["module"], e["module"]) == module and e.get("whole_module", True)), None)


def readme_figure(module: str, entry: Optional[dict]) -> str:
    """The sentence docs/development.md states for a module: its latest whole-module draw
    (tests/test_mutate_report.py checks that it says exactly this)."""
    if entry is None:
        return f"{module}: no fresh draw logged yet"
    k, s, t = entry["killed"], entry["survived"], entry["timeout"]
    seed = f"fresh seed {entry['seed']}" if entry.get("seed") is not None else "seed not recorded"
    when = f", drawn {entry['drawn_at']}" if entry.get("drawn_at") else ""
    commit = f" at commit {entry['commit']}" if entry.get("commit") else ""
    partial = f", INCOMPLETE: {entry['pending']} not run" if not entry.get("complete", True) else ""
    return (f"{module}: {k} killed / {k + s + t} = {entry['score']:.1f} % as run ({s} survived, {t} timeout, "
            f"{entry['equivalent']} equivalent; {entry['sampled']} sampled{partial}; {seed}{when}{commit})")


# ------------------------------------------------------------------------------------------------------------
# a run


def run_module(tree: Path, module: str, ms: list, args, meta: dict, save):
    """Run the sampled mutants `ms` of one module: describe each (equivalent and incompetent ones need no run),
    cover the selections of the files still to run (one coverage run), then run each mutant's tests. `save()`
    writes the progress after every step."""
    for m in ms:
        why = equivalent_reason(m) if describe(tree, m) else None
        if not m.diff:
            m.outcome = "incompetent"
        elif why:
            m.outcome, m.why = "equivalent", why
    save()
    todo = [m for m in ms if m.outcome == "pending"]
    slow = list(SLOW_TESTS)  # node ids outside the selection deselect nothing
    lines, failing, base_s = None, [], 200.0
    if todo and not args.skip_baseline:
        selection = args.tests or all_tests(module, tree, [m.path for m in todo])
        print(f"[mutate] {module}: coverage run of {len(selection)} test file(s), the selections of the sampled "
              f"files", file=sys.stderr, flush=True)
        failing, lines, base_s = baseline(tree, module, selection, max(args.timeout * 10, 3600), slow)
    deselected = meta.setdefault("deselected", {})
    deselected[module] = failing + args.deselect + slow
    timeout = args.timeout or max(120.0, 2 * base_s)
    print(f"[mutate] {module}: {len(ms)} of {meta['totals'][module]} mutants, {len(todo)} to run; unmutated run "
          f"{base_s:.0f}s, timeout {timeout:.0f}s" + (f"; deselected (already failing): {failing}" if failing else ""),
          file=sys.stderr, flush=True)
    for n, m in enumerate(ms, 1):
        if m.outcome == "pending":
            tests = args.tests or tests_for(module, m.path, tree)
            if lines is not None and not m.path.startswith(SUBPROCESS_TESTED):
                ids = covering_tests(m, lines, deselected[module],
                                     import_time_lines((tree / m.path).read_text(encoding="utf-8")))
                if not ids and not any(m.path.startswith(prefix) for prefix, _ in BY_FILE):
                    m.outcome, m.why = "survived", "no test runs this line"
                elif not ids:  # code coverage cannot see (traced by torch.compile): the file's tests
                    m.why = "no coverage record (e.g. run while dynamo traces): ran the file's tests"
                elif ids != [""]:
                    tests, m.tests = ["tests/" + i for i in ids], len(ids)
            if m.outcome == "pending":
                run_mutant(tree, m, pytest_command(module, deselected[module], tests), timeout)
            save()
        print(f"[mutate] {module} {n}/{len(ms)} {m.outcome:9s} {m.path}:{m.line} {m.operator} "
              f"({m.seconds:.0f}s, {m.tests or 'all'} tests){' ' + m.why if m.why else ''}",
              file=sys.stderr, flush=True)


def check_equivalents(out=None) -> int:
    out = out or sys.stdout
    stale = stale_equivalents()
    if stale:
        entries = "entry" if len(stale) == 1 else "entries"
        out.write(f"{len(stale)} stale EQUIVALENT {entries} (tools/mutation/mutate.py):\n")
        out.writelines(f"  {s}\n" for s in stale)
        return 1
    out.write(f"EQUIVALENT: {len(EQUIVALENT)} entries, each names a line that exists\n")
    return 0


def rescore(path: str, args) -> int:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    meta = data.pop("_meta", {"seed": "?", "fresh": False, "commit": "unknown"})
    results = {ALIASES.get(mod, mod): [Mutant(**m) for m in ms] for mod, ms in data.items()}
    sources = {}
    for ms in results.values():
        for m in ms:
            if m.scope is None and m.diff and not m.before.startswith("-"):  # a run before issue 22: locate
                f = ROOT / m.path  # the mutant in today's tree if its line is still there, unchanged
                sources.setdefault(m.path, f.read_text(encoding="utf-8").split("\n") if f.is_file() else [])
                src = sources[m.path]
                if 0 < m.line <= len(src) and src[m.line - 1] == m.before:
                    m.scope, m.nth = locate("\n".join(src), m.line)
            why = equivalent_reason(m) if m.diff else None
            if why and m.outcome in ("survived", "timeout"):
                m.outcome, m.why = "equivalent", why
    report(results, meta.get("totals", {}), meta.get("deselected", {}), args, meta=meta, rescored=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="./dev mutate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", choices=sorted(MODULES) + sorted(ALIASES) + ["all"], default="all",
                    help="engine (attention_core/) or nodes (nodes/, the ComfyUI nodes; 'adapter' is its old "
                         "name); default all")
    ap.add_argument("--file", action="append", default=[],
                    help="only mutants in files whose path contains this (repeatable), e.g. --file tiles.py")
    ap.add_argument("--sample", type=int, default=40, help="mutants per module, a seeded random sample (0 = all; "
                                                           "default 40)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sample (default: a fresh one from os.urandom, printed; the score that counts "
                         "is the as-run score of a fresh seed: a given seed repeats a sample and is not logged)")
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
    ap.add_argument("--list", action="store_true", help="count the mutants, run nothing (and name stale "
                                                        "EQUIVALENT entries)")
    ap.add_argument("--check-equivalents", action="store_true",
                    help="run nothing: name every EQUIVALENT entry whose line no longer exists (exit 1 if any)")
    ap.add_argument("--rescore", metavar="JSON",
                    help="no run: re-read a --json file (also a partial one), apply the current EQUIVALENT list, "
                         "print the report")
    ap.add_argument("--json", help="every mutant's outcome, rewritten after each mutant (default: "
                                   ".cache/mutation/seed-SEED.json)")
    ap.add_argument("--report", help="the markdown report, rewritten after each mutant (default: "
                                     ".cache/mutation/seed-SEED.md)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)

    if args.check_equivalents:
        return check_equivalents()
    if args.rescore:
        return rescore(args.rescore, args)
    os.environ.setdefault("COMFYUI_PATH", str(ROOT / ".cache" / "comfyui-0.3.75"))
    os.environ.setdefault("COMFYUI_LATEST_PATH", str(ROOT / ".cache" / "comfyui-0.33.0"))
    module = ALIASES.get(args.module, args.module)
    modules = sorted(MODULES) if module == "all" else [module]
    meta = {**choose_seed(args.seed), "sample": args.sample}
    if args.ref:
        meta["commit"] = _commit(args.ref)
    args.seed = meta["seed"]
    json_path = Path(args.json) if args.json else PROGRESS_DIR / f"seed-{meta['seed']}.json"
    report_path = Path(args.report) if args.report else PROGRESS_DIR / f"seed-{meta['seed']}.md"
    results, totals = {}, {}
    with tempfile.TemporaryDirectory(prefix="tiled-attention-mutants-") as tmp:
        tree = copy_tree(Path(tmp) / "tree", args.ref)
        for module in modules:  # draw every module's sample first: the coverage run covers only what it needs
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
            results[module] = ms
        if args.list:
            check_equivalents()
            return 0
        meta.update(totals=totals, complete=False, json=str(json_path), report=str(report_path))
        print(f"[mutate] {'fresh seed' if meta['fresh'] else 'seed (given)'} {meta['seed']}"
              + (f", drawn at {meta['drawn_at']}" if meta["fresh"] else "")
              + f"; tests of commit {meta['commit']} (repeat this sample with --seed {meta['seed']}); progress in "
                f"{json_path} and {report_path}"
              + (f"; the draw is logged in {DRAWS_LOG} when the run ends" if meta["fresh"] else ""),
              file=sys.stderr, flush=True)

        def save():
            write_progress(json_path, report_path, results, meta, args)

        def stop(signum, _frame):
            raise SystemExit(f"mutate: stopped by signal {signum}")

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            for module in modules:
                run_module(tree, module, results[module], args, meta, save)
            meta["complete"] = True
        except BaseException as e:
            meta["stopped"] = f"stopped ({type(e).__name__}: {str(e)[:300]})"
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            save()
            if meta["fresh"]:  # every fresh draw, finished or not, whatever it scored
                append_draws(draw_entries(results, meta, args))
                figures = "; ".join(readme_figure(m, latest_draw(read_draws(), m)) for m in modules)
                print(f"[mutate] draw logged in {DRAWS_LOG} (commit it; docs/development.md must state each module's latest "
                      f"whole-module draw: {figures})", file=sys.stderr, flush=True)
    report(results, totals, meta.get("deselected", {}), args, meta=meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
