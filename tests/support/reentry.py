"""Re-entry from the same thread, as a signal handler or a trace function makes it (issue 38 item 1): a deadline that
turns a deadlock into a failure, a real signal handler to run code in, and the check that the pack's switch state
agrees with itself.

A thread that waits on a lock it holds itself never wakes up; in the main thread a POSIX signal interrupts the wait,
so deadline() arms SIGALRM (signal.setitimer) with a handler that raises Deadlocked out of the wait: the test fails
instead of hanging. Signal handlers run in the main thread only, so these helpers are for it (pytest runs tests
there)."""
import contextlib
import os
import signal
import sys
import threading


class Deadlocked(AssertionError):
    pass


@contextlib.contextmanager
def deadline(seconds: float, what: str = "the call"):
    """Raise Deadlocked inside the block when it runs longer than `seconds` (a wait on a lock included)."""
    assert threading.current_thread() is threading.main_thread(), "signals reach the main thread only"

    def expired(signum, frame):
        raise Deadlocked(f"{what} still running after {seconds} s: a thread waiting on itself")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Handler:
    """A real SIGUSR1 handler that calls `action()`: its results and errors are kept (an error is not raised into
    the interrupted code, which must go on as if nothing happened); a Deadlocked is kept too, so the test fails."""

    def __init__(self, action, sig=signal.SIGUSR1):
        self.action, self.sig = action, sig
        self.results, self.errors = [], []
        self.previous = None

    def __enter__(self):
        self.previous = signal.signal(self.sig, self._run)
        return self

    def __exit__(self, *exc):
        signal.signal(self.sig, self.previous)

    def _run(self, signum, frame):
        try:
            self.results.append(self.action())
        except BaseException as e:  # noqa: BLE001 - kept for the test's assertion
            self.errors.append(e)

    def fire(self):
        """Send the signal to this process now: the handler runs at the interpreter's next check, on this thread,
        while the interrupted code is where it was (inside a trace function: at the traced line)."""
        os.kill(os.getpid(), self.sig)


def line_count_in(fn, files):
    """How many line events fn() makes in `files` (on this thread)."""
    from line_tracing import line_events
    return line_events(fn, files)[1]


def patch_agrees(patch, F, torch_sdpa):
    """The global patch's state agrees with what is asked for: installed iff enable() or a block holds it, torch's
    function ours iff installed, the Config in force the latest open block's, else enable()'s. Returns a reason
    when it does not, else None."""
    st = patch._state
    blocks, enabled = tuple(patch._blocks), patch._global
    want = enabled is not None or bool(blocks)
    cfg = blocks[-1][1] if blocks else (enabled if enabled is not None else patch.OFF)
    if st.installed != want:
        return f"installed={st.installed} but asked for: {want}"
    if (F.scaled_dot_product_attention is patch._patched_sdpa) != want:
        return f"torch's SDPA is {F.scaled_dot_product_attention}, installed={want}"
    if want and st.config != cfg:
        return f"Config in force {st.config}, asked for {cfg}"
    if not want and F.scaled_dot_product_attention is not torch_sdpa:
        return "off but torch's own SDPA not back"
    if getattr(patch, "_refreshing", False) or getattr(patch, "_dirty", False):
        return "a refresh left marked as running or pending"
    return None


def trace_calls(fn, files, action):
    """fn() with `action()` called from a sys.settrace function at each line event in `files`; the previous trace
    function put back after (coverage.py's). Returns fn()'s result."""
    def local(frame, event, arg):
        if event == "line":
            action()
        return local
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
    try:
        return fn()
    finally:
        sys.settrace(previous)
