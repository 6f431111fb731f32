"""How busy other processes kept this machine's CPUs while something was timed; the guard that keeps speed figures
measured on a loaded machine out of saved files (profiles, calibrations, docs figures).

What is measured: other processes' runnable threads, `others_runnable()`: the threads in state R (running or
waiting for a core) of every process in /proc except this process and its descendants (the timed child processes
of `bench`, the ComfyUI servers of the demo), counted directly in one scan of /proc/<pid>/stat (the parent pid)
and /proc/<pid>/task/<tid>/stat (the state); each thread is counted once, as ours or as another's. (Before issue
38 this was /proc/loadavg's running count less our runnable threads read moments later: one of our threads that
ran at the first read and slept at the second counted as another process's, so a quiet machine read as busy
under a demo whose server answers HTTP requests.) The 1-minute load average cannot tell the two apart: the
measurement itself keeps every core busy. Linux only; elsewhere (no /proc) the load is unknown (None), said so,
and never refuses anything. Where /proc hides other users' processes (mounted with hidepid), only the processes
this user may see are counted.

How it is sampled: `Monitor` reads it on a background thread every PERIOD_S (0.5 s) while the timed parts run, and
once more at the end of each timed figure (`Monitor.span()`), so a figure shorter than the period still has a
reading. A reading is a few small /proc files (well under a millisecond) on a thread that sleeps in between, next to
timed work that runs for tens of milliseconds to seconds: no measurable overhead. The figures print the mean of the
readings taken while they ran; the saved file gets `summary()`: {"mean", "max", "samples", "cores", "threshold",
"busy", "forced"}.

The threshold, SHARE = 0.25: busy when other processes' runnable threads averaged more than a quarter of the
cores over the timed parts (0.5 on 2 cores), the rule the demo's verdict has always used (tools/demo/demo_summary.py).
Why there: the timed work keeps every core busy, so k other runnable threads take about k / (cores + k) of the CPU
from it; at cores / 4 that is a fifth of the CPU, so a figure can be 25 % slow, more than the differences the saved
files decide (tune keeps the smallest tile within 3 % of the fastest; the calibration ranks methods 10-40 % apart).
Worse, the loss is not even: the engine's tiles are many short parallel regions, and each one waits for its
slowest thread, so one descheduled thread stalls all of them (issue 24); a loaded machine ranked the pack and
sub-quadratic backwards. Below a quarter, the readings are mostly the odd blip (a shell, a log writer), and the
interleaved rounds of `bench` spread what is left over every method alike.

The guard: `python -m attention_core.bench` (--json, --plot), `tune`, `calibrate` and `tools.measure.predict_step`
(--log) refuse to save over the threshold (`refusal()`: one `error:` line naming the load, the threshold and FORCE_FLAG;
exit 2, after the figures are printed) unless given FORCE_FLAG, and the saved file then records the load with "forced":
true. No torch import here.
"""
from __future__ import annotations

import math
import os
import statistics
import threading
from contextlib import contextmanager
from typing import Iterable, Optional

PROC = "/proc"
PERIOD_S = 0.5        # background sampling period while timed work runs
SHARE = 0.25          # busy above this share of the cores, on average, taken by other processes' runnable threads
FORCE_FLAG = "--force-busy"


def cores() -> int:
    """The CPUs this machine has (os.cpu_count(), at least 1)."""
    return os.cpu_count() or 1


def threshold(n_cores: Optional[int] = None) -> float:
    """Other processes' mean runnable threads above which the machine counts as busy: SHARE x the cores."""
    return SHARE * (n_cores or cores())


def _stat_fields(text: str) -> list:
    """The fields of a /proc stat line after the command name (which may hold spaces and parentheses): state first."""
    return text.rsplit(")", 1)[1].split()


def _scan(proc: str) -> Optional[dict]:
    """{pid: (parent pid, threads in state R)} of every process in `proc` now (a process or thread that ends
    during the scan is left out); None when `proc` cannot be listed (not Linux)."""
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    out = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                ppid = int(_stat_fields(f.read())[1])
        except (OSError, ValueError, IndexError):  # the process ended meanwhile, or an unreadable entry
            continue
        out[int(name)] = (ppid, _runnable_threads(int(name), proc))
    return out


def _tree(parents: dict, root: int) -> set:
    """`root` and its descendants among `parents` {pid: parent pid}."""
    children: dict = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def own_tree(root: Optional[int] = None, proc: Optional[str] = None) -> set:
    """`root` (default: this process) and every process descended from it, from each process's parent pid in
    /proc/<pid>/stat; empty where /proc cannot be read."""
    scan = _scan(proc or PROC)
    if scan is None:
        return set()
    return _tree({pid: ppid for pid, (ppid, _) in scan.items()}, os.getpid() if root is None else root)


def _runnable_threads(pid: int, proc: str) -> int:
    """Threads of process `pid` in state R (running or runnable) now; 0 when it has ended."""
    n = 0
    try:
        tids = os.listdir(os.path.join(proc, str(pid), "task"))
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(os.path.join(proc, str(pid), "task", tid, "stat")) as f:
                n += _stat_fields(f.read())[0] == "R"
        except (OSError, IndexError):  # the thread ended meanwhile
            pass
    return n


def runnable_by_process(pids: Optional[Iterable[int]] = None, proc: Optional[str] = None) -> Optional[tuple]:
    """One scan of /proc: ({pid: runnable threads} of the other processes that have any, {pid: runnable threads}
    of ours), ours being `pids` (default: this process and its descendants) and, with the default, the
    descendants found in the same scan; None where /proc cannot be read."""
    scan = _scan(proc or PROC)
    if scan is None:
        return None
    ours = (_tree({pid: ppid for pid, (ppid, _) in scan.items()}, os.getpid()) if pids is None else set(pids))
    others = {pid: n for pid, (_, n) in scan.items() if n and pid not in ours}
    return others, {pid: scan[pid][1] for pid in ours if pid in scan}


def others_runnable(pids: Optional[Iterable[int]] = None, proc: Optional[str] = None) -> Optional[int]:
    """Threads of *other* processes runnable right now, counted directly (runnable_by_process): every process's
    threads in state R except those of `pids` (default: this process and its descendants; this reading thread is
    one of them). None where /proc is not there or not readable (not Linux): unknown."""
    got = runnable_by_process(pids, proc)
    return None if got is None else sum(got[0].values())


def _summary(samples: list) -> dict:
    known = [s for s in samples if s is not None]
    return {"mean": statistics.fmean(known) if known else None, "max": max(known) if known else None,
            "samples": len(known)}


class Span:
    """The readings taken while one timed figure ran (`Monitor.span()`)."""

    def __init__(self):
        self.samples: list = []

    @property
    def mean(self) -> Optional[float]:
        return _summary(self.samples)["mean"]

    @property
    def max(self) -> Optional[int]:
        return _summary(self.samples)["max"]

    def text(self) -> str:
        """'others 0.5 (max 1)': other processes' runnable threads while it ran; 'others ?' when unknown."""
        return figure_text(self.mean, self.max)


def figure_text(mean: Optional[float], peak: Optional[int] = None) -> str:
    """How a figure prints the load it was measured at."""
    if mean is None:
        return "others ?"
    return f"others {mean:.1f}" + (f" (max {peak})" if peak is not None and peak != round(mean) else "")


class Monitor:
    """Other processes' runnable threads over the timed parts of a run: between start() and stop() (or inside
    `with Monitor() as m:`) a background thread reads others_runnable() every `period` seconds while a timed
    figure runs (`with m.span() as s:`), and each span also takes a reading as it ends. All readings count for
    summary(); a span's readings are those taken while it was open. `source`: the reading function (default:
    others_runnable)."""

    def __init__(self, period: float = PERIOD_S, source=None, n_cores: Optional[int] = None, force: bool = False):
        self.period, self.source, self.force = period, source, force
        self.cores = n_cores or cores()
        self.samples: list = []
        self.figures: dict = {}  # key -> Span of the spans opened with a key
        self._open: list = []
        self._lap: Optional[Span] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def read(self) -> None:
        """Take one reading now (into the run and every open span)."""
        value = (self.source or others_runnable)()
        with self._lock:
            self.samples.append(value)
            for span in self._open:
                span.samples.append(value)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            if self._open:  # only while a timed figure runs
                self.read()

    def start(self) -> "Monitor":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="machine-load", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @contextmanager
    def span(self, key=None):
        """One timed figure: yields a Span that holds the readings taken while it ran, plus one at its end (taken
        after the timed code, so it costs the figure nothing); kept in self.figures[key] when a key is given. A key
        seen before adds to its Span: a figure timed over interleaved rounds (calibrate.interleaved) holds the
        readings of all its rounds."""
        s = self.figures.get(key) if key is not None else None
        if s is None:
            s = Span()
            if key is not None:
                self.figures[key] = s
        with self._lock:
            self._open.append(s)
        try:
            yield s
        finally:
            with self._lock:
                self._open.remove(s)
            value = (self.source or others_runnable)()
            with self._lock:
                self.samples.append(value)
            s.samples.append(value)

    def lap(self) -> Span:
        """Laps for a command that logs one line per figure: the readings since the previous lap() (its figure;
        one more reading is taken now, after the timed code), and the next lap starts. The first call starts
        the first lap and returns an empty Span."""
        prev = self._lap
        if prev is not None:
            value = (self.source or others_runnable)()
            with self._lock:
                self.samples.append(value)
                prev.samples.append(value)
        nxt = Span()
        with self._lock:
            if prev is not None:
                self._open.remove(prev)
            self._open.append(nxt)
            self._lap = nxt
        return prev or Span()

    def summary(self) -> dict:
        """The "load" field of a saved file: {"mean", "max", "samples" (readings that were known), "cores",
        "threshold", "busy", "forced" (saved although busy, with FORCE_FLAG)}; mean / max None when unknown."""
        out = _summary(self.samples)
        limit = threshold(self.cores)
        busy = out["mean"] is not None and out["mean"] > limit
        return {**out, "cores": self.cores, "threshold": limit, "busy": busy, "forced": bool(busy and self.force)}

    @property
    def busy(self) -> bool:
        return self.summary()["busy"]

    def text(self) -> str:
        return describe(self.summary())


def describe(summary: dict) -> str:
    """One phrase for a run's load summary: 'other processes' runnable threads 0.30 on average (max 2, 40
    readings) on 2 cores; busy above 0.5'."""
    if summary.get("mean") is None:
        return (f"other processes' runnable threads not known (no reading of /proc/loadavg) on "
                f"{summary['cores']} cores; not checked")
    return (f"other processes' runnable threads {summary['mean']:.2f} on average (max {summary['max']}, "
            f"{summary['samples']} readings) on {summary['cores']} cores; busy above {summary['threshold']:g}")


def refusal(summary: dict, what: str) -> Optional[str]:
    """The one `error:` line (without 'error: ') refusing to save `what` on a busy machine, or None when the run
    may be saved (quiet, unknown, or forced)."""
    if not summary.get("busy") or summary.get("forced"):
        return None
    return (f"machine busy: other processes kept {summary['mean']:.2f} threads runnable on average (max "
            f"{summary['max']}) on {summary['cores']} cores while this measured, above the threshold "
            f"{summary['threshold']:g} (a quarter of the cores): {what} not saved; the figures above are "
            f"unreliable. Stop the other work and run it again, or pass {FORCE_FLAG} to save anyway (the file "
            "then records the load)")


def load_problem(obj) -> Optional[str]:
    """None when `obj` is a load summary as summary() writes it into a saved file (the optional "load" field of
    profiles, calibrations and bench JSON), else what is wrong with it. Validators of those files use this."""
    def number(x, whole=False):
        return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                and (not whole or float(x).is_integer()))
    if not isinstance(obj, dict):
        return f"is {type(obj).__name__}, not an object"
    for key in ("mean", "max"):
        if obj.get(key) is not None and not number(obj[key]):
            return f"{key} {obj[key]!r} is not a number >= 0 or null"
    if not number(obj.get("samples", 0), whole=True):
        return f"samples {obj.get('samples')!r} is not a whole number >= 0"
    if not (number(obj.get("cores"), whole=True) and obj["cores"] >= 1):
        return f"cores {obj.get('cores')!r} is not a whole number >= 1"
    if not number(obj.get("threshold")):
        return f"threshold {obj.get('threshold')!r} is not a number >= 0"
    for key in ("busy", "forced"):
        if not isinstance(obj.get(key, False), bool):
            return f"{key} {obj[key]!r} is not true/false"
    return None
