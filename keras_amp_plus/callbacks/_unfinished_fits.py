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
over, once its `fit` call is no longer running (its frame is off the call
stack): the same model's next `fit` or `train_on_batch` (they build the train
function without `force`), or any monitored `fit` in the same thread.
"""

import inspect
import logging
import threading
import weakref

logger = logging.getLogger("keras_amp_plus")

ENDED_LATE = (
    "AMPMonitor: the last monitored `fit` of model %r stopped on an exception "
    "raised outside its train steps (by a callback, or a KeyboardInterrupt "
    "between steps), and Keras ran no `on_train_end`. Ending it now: the "
    "events of its last steps are written, its record goes back to its last "
    "completed epoch (the next `fit` continues from there), the model has its "
    "own train step back and any graph rewrite the monitor switched on is off."
)

# `(reference to a session, its thread)` for each session begun and not yet
# ended, oldest first. A graph engine's session is held strongly: its global
# switches stay on until it ends. A layer engine's is held weakly: it changed
# nothing beyond its model, which it must not keep alive.
_unfinished = []


def begin(session) -> None:
    """Note that `session` runs in the `fit` on this call stack, until `finish`.

    Its `fit` frame is the innermost one of its model on the stack (none
    when the callback hooks are called by hand: then nothing runs it).
    """
    session.fit_frame = _innermost_fit_frame(session.model)
    strong = session.engine.level == "op"
    reference = (lambda: session) if strong else weakref.ref(session)
    _unfinished.append((reference, threading.get_ident()))


def _entry_of(session):
    """Return the `_unfinished` entry of `session`, or None once it ended."""
    return next((entry for entry in _unfinished if entry[0]() is session), None)


def finish(session) -> bool:
    """Note that `session` ended; return False when it had ended already."""
    entry = _entry_of(session)
    if entry is None:
        return False
    _unfinished.remove(entry)
    session.fit_frame = None  # its locals are not kept alive
    return True


def is_running(session) -> bool:
    """Return whether the `fit` call of `session` is on this call stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame is session.fit_frame:
                return True
            frame = frame.f_back
        return False
    finally:
        del frame  # a frame refers to its locals: no cycle left behind


def end_late(session) -> None:
    """End `session` unless its `fit` runs; warn that it ended without ending.

    A `train_on_batch` or `fit` of the same model called from one of the
    running `fit`'s callbacks leaves it running.
    """
    if session.fit_frame is not None and is_running(session):
        return
    if _entry_of(session) is None:
        return
    logger.warning(ENDED_LATE, session.model.name)
    try:
        session.abort()
    except Exception:  # the new `fit` must not fail for the old one
        logger.exception("AMPMonitor could not end the earlier `fit`.")


def end_those_left_behind(model) -> None:
    """End every unfinished `fit` of this thread whose call returned.

    Called as a monitored `fit` of `model` begins. One running in another
    thread, or around this one (this `fit` runs from its callback), is left
    alone, except that `model` itself cannot be monitored twice at once.

    Raises:
        ValueError: when a running `fit` of `model` is monitored already.
    """
    thread_id = threading.get_ident()
    for reference, thread in list(_unfinished):
        session = reference()
        if session is None:
            _unfinished.remove((reference, thread))
        elif thread == thread_id and not is_running(session):
            end_late(session)
        elif thread == thread_id and session.model is model:
            raise ValueError(
                "A running `fit` of this model is monitored by an AMPMonitor "
                "already: one monitor per model at a time (each instruments "
                "the train step). Pass a single AMPMonitor in `callbacks`, and "
                "call no monitored `fit` of the model from inside its own "
                f"`fit`. Received: model={model.name!r}, already monitored by "
                f"an AMPMonitor with log_dir={session.monitor.log_dir!r}"
            )


def _innermost_fit_frame(model):
    """Return the innermost frame of `model.fit` on this call stack, or None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return frame
            frame = frame.f_back
        return None
    finally:
        del frame
