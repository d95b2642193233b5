"""The one deliberate global: the tracer that is recording right now, if any.

Everything else in stagewise passes data explicitly. The tracer is the
exception because it observes every stage without changing any signature;
when no tracer is active, `active_tracer()` returns None and the stage runs
with no extra work.
"""

_ACTIVE = []  # stack of active tracers; the innermost records


def active_tracer():
    return _ACTIVE[-1] if _ACTIVE else None


def push_tracer(tracer) -> None:
    _ACTIVE.append(tracer)


def pop_tracer(tracer) -> None:
    if _ACTIVE and _ACTIVE[-1] is tracer:
        _ACTIVE.pop()
