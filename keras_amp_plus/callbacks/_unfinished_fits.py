"""Monitored `fit`s that Keras never ended, and ending them at the next sign.

`fit` calls no callback when it stops on an exception raised outside its train
function: another callback's, or a `KeyboardInterrupt` that lands between two
steps (as Ctrl-C in a notebook mostly does). An exception inside a step ends
the monitor's `fit` there (`StepRecorder._stopping_cleanly`); one outside
would leave it running: the model keeps the monitor's wrapped step (its next
plain `fit` would still leave skipped steps out of its loss), a graph engine's
rewrite stays on for every later model of the process, and the record misses
the events since its last read. Each such `fit` is ended as a step's exception
ends it (`MonitorSession.abort`), with a warning, at the first sign that it is
over: the same model's next `fit` or `train_on_batch` (the only callers of
`make_train_function` without `force`, before any callback runs), or a
monitored `fit` of another model in the same thread, when the unfinished one
is not on its call stack (a `fit` called from inside another's callback).
"""

import inspect
import logging
import threading

logger = logging.getLogger("keras_amp_plus")

ENDED_LATE = (
    "AMPMonitor: the last monitored `fit` of model %r stopped on an exception "
    "raised outside its train steps (by a callback, or a KeyboardInterrupt "
    "between steps), and Keras ran no `on_train_end`. Ending it now: the "
    "events of its last steps are written, its record goes back to its last "
    "completed epoch (the next `fit` continues from there), the model has its "
    "own train step back and any graph rewrite the monitor switched on is off."
)

# Sessions begun and not yet closed or aborted, oldest first. Strong
# references: a graph engine's switches stay on until its session ends.
_unfinished = []


def begin(session) -> None:
    """Note that `session` runs a `fit`, in this thread, until `finish`."""
    session.thread_id = threading.get_ident()
    _unfinished.append(session)


def finish(session) -> bool:
    """Note that `session` ended; return False when it had ended already."""
    if session not in _unfinished:
        return False
    _unfinished.remove(session)
    return True


def end_late(session) -> None:
    """End `session`, whose `fit` stopped without ending it; warn that it did."""
    if session not in _unfinished:
        return
    logger.warning(ENDED_LATE, session.model.name)
    session.abort()


def end_those_left_behind(model) -> None:
    """End every unfinished `fit` of this thread that is not running any more.

    Called as a monitored `fit` of `model` begins: an unfinished one of the
    same model is over; one running in another thread, or whose `fit` this
    one runs inside of (from a callback), is left alone.
    """
    thread_id = threading.get_ident()
    for session in list(_unfinished):
        if session.thread_id != thread_id:
            continue
        if session.model is model or not _fit_is_running(session.model):
            end_late(session)


def _fit_is_running(model) -> bool:
    """Return whether `model.fit` (or `train_on_batch`) is on this call stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            runs_it = frame.f_code.co_name in ("fit", "train_on_batch")
            if runs_it and frame.f_locals.get("self") is model:
                return True
            frame = frame.f_back
        return False
    finally:
        del frame  # a frame refers to its locals: no cycle left behind
