"""sys.settrace helpers for the switching tests: run code with a line-event hook in chosen files, then put back the
trace function that was there (coverage.py's tracer under ./dev mutate: clearing it would leave every later test
of a coverage run unrecorded)."""
import sys


def line_events(fn, files, at=None, switch=None):
    """fn() under sys.settrace on this thread: count the line events in frames of `files` and, at the one numbered
    `at`, call switch() first (then stop tracing: the rest of the call runs at full speed). Returns (fn's result,
    line events)."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            if seen[0] == at:
                switch()
                sys.settrace(None)
            seen[0] += 1
        return local
    previous_trace = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
    try:
        return fn(), seen[0]
    finally:
        sys.settrace(previous_trace)
