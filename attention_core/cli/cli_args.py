"""The engine's command lines' argument checks: one `error: ...` line naming the flag and what it accepts, exit 2.

`Parser` is argparse.ArgumentParser whose errors are that one line (no usage block, no traceback). The factories
below are argparse `type=` callables: each returns the cleaned value or raises argparse.ArgumentTypeError with
what the flag accepts, which argparse prefixes with "argument --flag:". Comma lists come back as the cleaned
comma-separated string (callers split on ","), so code that read the raw string keeps working.
Output paths are checked by trying, before any work: a file is created in the folder and removed again, and an
existing file is opened for appending (nothing truncated), because permission bits say "yes" to root on a read-only
mount and say nothing of ACLs; `output_file`, `writable_path` (a default path whose folder may still be made) and
`keep_elsewhere` (where a result goes when writing it fails anyway) serve the commands that measure for minutes.
torch is imported only inside `device` and `default_device` (attention_core.plan stays torch-free at import).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Optional

DTYPES = ("float32", "float16", "bfloat16", "float64")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp64": "float64"}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: <message>` on stderr, exit status 2; every command has `--version`
    (the pack's version, `attention_core.version.version()`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from ..version import version
        self.add_argument("--version", action="version", version=f"%(prog)s {version()} (tiled-attention)")

    def error(self, message):  # noqa: D102 - argparse's hook
        self.exit(2, "error: " + " ".join(str(message).split()) + "\n")


def _bad(expected: str, value) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")


def _num(x) -> str:
    """1000000 -> '1,000,000', 1e-06 -> '0.000001'."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:.12f}".rstrip("0")


def _span(lo, hi, unit="") -> str:
    return f">= {_num(lo)}{unit}" if hi is None else f"from {_num(lo)} to {_num(hi)}{unit}"


def int_range(lo: int = 1, hi: int | None = None):
    """A whole number lo <= x <= hi (hi None: no upper bound)."""
    expected = f"a whole number {_span(lo, hi)}"

    def parse(s):
        try:
            x = int(str(s).strip(), 10)
        except ValueError:
            raise _bad(expected, s) from None
        if x < lo or (hi is not None and x > hi):
            raise _bad(expected, s)
        return x
    parse.__name__ = "whole number"
    return parse


def float_range(lo: float, hi: float, unit: str = ""):
    """A finite number lo <= x <= hi (not nan, not inf)."""
    expected = f"a number {_span(float(lo), float(hi), unit)}"

    def parse(s):
        try:
            x = float(str(s).strip())
        except ValueError:
            raise _bad(expected, s) from None
        if not math.isfinite(x) or not lo <= x <= hi:
            raise _bad(expected, s)
        return x
    parse.__name__ = "number"
    return parse


def _items(s, what):
    items = [i.strip() for i in str(s).split(",")]
    if not any(items):
        raise _bad(what, s)
    return [i for i in items if i]


def choice_list(choices, what: str = "names"):
    """Comma-separated names, each one of `choices`; the cleaned string (duplicates dropped, order kept)."""
    choices = tuple(choices)
    expected = f"comma-separated {what} from: {', '.join(choices)}"

    def parse(s):
        items = _items(s, expected)
        unknown = [i for i in items if i not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; expected {expected}")
        return ",".join(dict.fromkeys(items))
    parse.__name__ = what
    return parse


def int_list(lo: int = 1, hi: int | None = None):
    """Comma-separated whole numbers lo <= x <= hi; the cleaned string."""
    one = int_range(lo, hi)
    expected = f"comma-separated whole numbers {_span(lo, hi)}"

    def parse(s):
        try:
            return ",".join(str(one(i)) for i in _items(s, expected))
        except argparse.ArgumentTypeError:
            raise _bad(expected, s) from None
    parse.__name__ = "numbers"
    return parse


def dtype_list(s):
    """Comma-separated torch dtype names (float32, float16, bfloat16, float64; fp32, fp16, half, bf16, fp64)."""
    expected = f"comma-separated dtypes from: {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
    items = _items(s, expected)
    names = [DTYPE_ALIASES.get(i.lower(), i.lower()) for i in items]
    unknown = [i for i, n in zip(items, names) if n not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; expected {expected}")
    return ",".join(dict.fromkeys(names))


def existing_file(s):
    """A path to a readable file that exists."""
    if not str(s).strip():
        raise _bad("the path of an existing file", s)
    if not os.path.exists(s):
        raise argparse.ArgumentTypeError(f"{s!r} does not exist; expected the path of an existing file")
    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"{s!r} is not a file; expected the path of an existing file")
    if not os.access(s, os.R_OK):
        raise argparse.ArgumentTypeError(f"{s!r} is not readable")
    return s


def _not_a_folder(folder: str) -> Optional[str]:
    """The nearest existing path at or above `folder` when it is not a folder (a file where a folder should be:
    nothing can be made under it), else None."""
    p = os.path.abspath(folder)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return None if os.path.isdir(p) else p


def _try_write(folder: str) -> Optional[str]:
    """None when a file can be created in the existing `folder` (it is removed again), else why not."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tiled-attention-write-check-", dir=folder)
    except OSError as e:
        return f"folder {folder!r} is not writable ({e.strerror or e})"
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return None


def folder_problem(folder: str, create: bool = False) -> Optional[str]:
    """Why no file can be written in `folder`, or None. A path component that is a file: "'...' is a file, not a
    folder"; a missing folder: "does not exist" (create: fine when its nearest existing parent is writable, as
    attention_core.device.jsonfile makes missing folders); permissions are read (os.access) and then tried."""
    blocker = _not_a_folder(folder)
    if blocker is not None:
        return f"{blocker!r} is a file, not a folder" if os.path.isfile(blocker) else f"{blocker!r} is not a folder"
    folder = os.path.abspath(folder)
    probe = folder
    if not os.path.isdir(folder):
        if not create:
            return f"folder {folder!r} does not exist"
        while not os.path.isdir(probe):
            probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"folder {probe!r} is not writable" + ("" if probe == folder else f", so {folder!r} cannot be made")
    return _try_write(probe)


def file_problem(path: str) -> Optional[str]:
    """Why the existing regular file `path` cannot be overwritten (read-only, or opening it for appending fails:
    nothing is truncated or changed), or None (also when it does not exist)."""
    if not os.path.isfile(path):
        return None
    if not os.access(path, os.W_OK):
        return f"file {path!r} is not writable (read-only)"
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        return f"file {path!r} is not writable ({e.strerror or e})"
    return None


def writable_path(path: str) -> Optional[str]:
    """Why the file `path` cannot be written, or None: not a folder, its folder writable or makeable (folders are
    created on save), an existing file itself writable. For a command's default output path, checked before
    it measures."""
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    return folder_problem(os.path.dirname(os.path.abspath(path)), create=True) or file_problem(path)


def output_file(s):
    """A file path to write: not a folder, in a folder that exists and is writable (tried), and when the file
    exists, the file itself writable (tried without truncating it)."""
    if not str(s).strip():
        raise _bad("a file path to write", s)
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a folder; expected a file path to write")
    parent = os.path.dirname(os.path.abspath(s))
    bad = folder_problem(parent)
    if bad and not os.path.isdir(parent):  # a file where the folder should be, or a missing folder
        raise argparse.ArgumentTypeError(f"{bad}; expected a file path in an existing folder")
    bad = bad or file_problem(s)
    if bad:
        raise argparse.ArgumentTypeError(bad)
    return s


def keep_elsewhere(text: str, name: str) -> Optional[str]:
    """Write `text` to a new file in the temporary folder (its name starts with `name`) when the output a command
    measured for could not be written after all (the folder vanished, the disk filled): the path, or None."""
    stem, ext = os.path.splitext(os.path.basename(name))
    try:
        fd, path = tempfile.mkstemp(prefix=f"{stem}-", suffix=ext)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return None
    return path


def comfyui_folder(s):
    """A ComfyUI folder: one with comfy/model_management.py."""
    if not str(s).strip() or not os.path.isfile(os.path.join(s, "comfy", "model_management.py")):
        raise _bad("a ComfyUI folder (one with comfy/model_management.py)", s)
    return s


def device(s):
    """'cpu' (or 'cpu:0'), 'cuda' or 'cuda:N' for a GPU this torch sees (ROCm GPUs are 'cuda' in torch); the cleaned name."""
    import torch
    name = str(s).strip().lower()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        accepted = "cpu, cuda" + (f", cuda:0 to cuda:{n - 1}" if n > 1 else ", cuda:0")
    else:
        accepted = "cpu (this torch sees no GPU)"
    kind, colon, index = name.partition(":")
    if name in ("cpu", "cpu:0"):  # torch's own name for the one CPU device is either
        return "cpu"
    if kind != "cuda" or (colon and not index.isdigit()):  # "cuda:" is no device torch knows
        raise argparse.ArgumentTypeError(f"unknown device {s!r}; accepted: {accepted}")
    if not n:
        build = (f"ROCm/HIP {torch.version.hip}" if getattr(torch.version, "hip", None) else
                 f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build")
        raise argparse.ArgumentTypeError(f"{s!r} asks for a GPU, but torch {torch.__version__} ({build}) sees none; "
                                         "accepted here: cpu")
    if index and int(index) >= n:
        raise argparse.ArgumentTypeError(f"no GPU {s!r}: this torch sees {n}; accepted: {accepted}")
    return name


def default_device() -> str:
    """The device a command measures when --device is not given: the first GPU this torch sees, else the CPU."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def fail(parser: argparse.ArgumentParser, flag: str, message: str):
    """A problem found after parsing (it depends on several flags): the same one line, naming `flag`."""
    parser.error(f"argument {flag}: {message}")


CALLER_CWD = "TILED_ATTENTION_CALLER_CWD"  # set by ./dev, which runs its commands from the clone: the caller's folder


def caller_path(path: str) -> str:
    """`path` as the user meant it: relative to the folder the command was called from, $TILED_ATTENTION_CALLER_CWD
    (which ./dev sets before it moves into the clone; ~ expanded); without it, `path` unchanged (relative to the
    current folder)."""
    here = os.environ.get(CALLER_CWD)
    path = str(path)
    if not here or not path.strip():
        return path
    return os.path.join(here, os.path.expanduser(path))


def at_caller(parse):
    """An argparse `type=` that reads a path from the caller's folder (caller_path), then checks it with `parse`."""
    def wrapped(s):
        return parse(caller_path(s))
    wrapped.__name__ = getattr(parse, "__name__", "path")
    return wrapped
