"""What every engine shares: the interface and rebuilding a model's functions.

TF optimizes a `tf.function` once, when it is instantiated, and caches it; a
changed dtype policy or list does nothing to a `train_function` that already
exists. So after any change an engine rebuilds the model's cached functions
with `make_*_function(force=True)`. It never sets `train_function = None`:
`fit` built the function once and calls `model.train_function` every step, so
replacing it is safe between epochs, deleting it is not.
"""

import warnings
import weakref

import keras

from keras_amp_plus import _compat
from keras_amp_plus._lists.op_types import op_types_for_layer
from keras_amp_plus._lists.precision_lists import PrecisionLists

# The engine that last took effect on each model, for `precision_report(model)`.
_LAST_ENGINES = weakref.WeakKeyDictionary()


def remember_engine(model: keras.Model, engine: "Engine") -> None:
    """Record `engine` as the one whose lists now decide `model`'s precision."""
    _LAST_ENGINES[model] = engine


def last_engine(model: keras.Model) -> "Engine | None":
    """Return the engine that last took effect on `model`, or None.

    Example:
    >>> import keras
    >>> last_engine(keras.Sequential()) is None
    True
    """
    return _LAST_ENGINES.get(model)


def rebuild_functions(model: keras.Model) -> None:
    """Rebuild the model's train function, and its test/predict ones if built.

    Args:
        model: a compiled Keras model (an uncompiled model has no train
            function; only existing test/predict functions are rebuilt then).
    """
    if _compat.is_compiled(model) or model.train_function is not None:
        model.make_train_function(force=True)
    if model.test_function is not None:
        model.make_test_function(force=True)
    if model.predict_function is not None:
        model.make_predict_function(force=True)


class RebuildRecord:
    """The settings an op engine last rebuilt a model's functions under.

    Grappler (and ITEX) optimize a function once, at its first call, under the
    settings of that moment. So an engine that applies the settings its last
    rebuild of this very train function ran under can leave the function as it
    is: every `fit` with `AMPMonitor` applies the lists anew, and tracing a
    large model's step again costs seconds (plus XLA compiles of its layers).
    The function is held weakly: it holds the model.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> record = RebuildRecord()
    >>> record.is_current(model, {"denylist": "MatMul"})
    False
    >>> record.rebuild(model, {"denylist": "MatMul"})
    >>> record.is_current(model, {"denylist": "MatMul"})
    True
    >>> record.is_current(model, {"denylist": "Conv2D"})
    False
    """

    def __init__(self):
        self._settings = None
        self._function = None

    def is_current(self, model: keras.Model, settings) -> bool:
        """Whether `model`'s train function was last rebuilt under `settings`.

        Args:
            model: the Keras model.
            settings: the engine's comparable description of its settings.
        """
        function = self._function() if self._function is not None else None
        return (
            function is not None
            and function is model.train_function
            and self._settings == settings
        )

    def rebuild(self, model: keras.Model, settings) -> None:
        """Rebuild `model`'s functions (`rebuild_functions`) under `settings`.

        Args:
            model: the Keras model.
            settings: the engine's comparable description of its settings.
        """
        rebuild_functions(model)
        try:
            self._function = weakref.ref(model.train_function)
        except TypeError:  # None: an uncompiled model has no train function
            self._function = None
        self._settings = settings


class GlobalStateStack:
    """Engines applied to one process-global state, each with the state it found.

    A graph engine's lists live in process-global state (environment
    variables, grappler's options, ITEX's config), so two engines at once
    (two models, each with its own) must not undo each other. Each engine
    applied and not yet restored is on this stack, in the order of its last
    `apply`, with the state it replaced. Restoring the top engine puts its
    state back; restoring one below hands its state to the engine above it,
    whose lists stay in force. An engine applying again while others are above
    it moves to the top. So once every engine is restored, in any order, the
    process is as before the first, and the lists in force are always those of
    the engine that applied last.

    Example:
    >>> stack = GlobalStateStack()
    >>> stack.push("first", "user's state")
    >>> stack.push("second", "first's lists")
    >>> stack.original("now")
    "user's state"
    >>> stack.release("first", print)  # "second" now holds the user's state
    >>> stack.release("second", print)
    user's state
    """

    def __init__(self):
        self._entries = []  # [engine, the state it replaced], oldest first

    def _position(self, engine) -> int | None:
        for position, (applied, _) in enumerate(self._entries):
            if applied is engine:
                return position
        return None

    def holds(self, engine) -> bool:
        """Whether `engine` is applied and not yet restored."""
        return self._position(engine) is not None

    def original(self, current):
        """Return the state before any engine still applied, else `current`.

        Args:
            current: the global state now, returned when no engine is applied.
        """
        return self._entries[0][1] if self._entries else current

    def push(self, engine, replaced) -> None:
        """Record that `engine` has just applied its lists over `replaced`.

        Already on the stack, an engine on top keeps the state it first
        replaced; one lower down hands that state on and moves to the top.

        Args:
            engine: the engine that applied.
            replaced: the global state just before this `apply`.
        """
        position = self._position(engine)
        if position == len(self._entries) - 1:
            return
        if position is not None:
            self._hand_on(position)
        self._entries.append([engine, replaced])

    def release(self, engine, put_back) -> None:
        """Take `engine` off the stack; `put_back(state)` if it was on top.

        Args:
            engine: the engine being restored (nothing happens if it is not
                on the stack).
            put_back: a function restoring a state `push` received.
        """
        position = self._position(engine)
        if position is None:
            return
        if position == len(self._entries) - 1:
            put_back(self._entries.pop()[1])
        else:
            self._hand_on(position)

    def _hand_on(self, position) -> None:
        # The engine above saved the state this one's lists made; it must
        # put back what this one found instead.
        _, replaced = self._entries.pop(position)
        self._entries[position][1] = replaced


def warn_if_xla(model: keras.Model, engine_name: str) -> None:
    """Warn that XLA-compiled functions bypass graph rewrites."""
    if getattr(model, "jit_compile", False):
        warnings.warn(
            f"Model {model.name!r} is compiled with `jit_compile=True`: grappler "
            f"skips XLA functions, so the {engine_name!r} engine's op lists have "
            "no effect. Compile with `jit_compile=False`, or use engine='keras'.",
            stacklevel=3,
        )


class Engine:
    """Where `PrecisionLists` take effect.

    Subclasses set `name` and `level` ("layer" or "op") and implement `apply`
    and `restore`.
    """

    name = "engine"
    level = "op"

    def apply(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Make `lists` take effect for `model`, then rebuild its functions.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists`.
        """
        raise NotImplementedError

    def check_lists(self, lists: PrecisionLists) -> None:
        """Raise when `lists` holds entries this engine cannot apply (default: none).

        Args:
            lists: a `keras_amp_plus.PrecisionLists`.
        """

    def check_available(self, model: keras.Model) -> None:
        """Raise a clear error if this engine cannot work here (default: it can).

        Called before training starts, so that an engine that would do
        nothing (and leave the model silently in float32) fails loudly first.

        Args:
            model: the Keras model the engine will act on.
        """

    def start(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Make the engine take effect at the start of training.

        A layer engine has nothing to do for empty lists (the dtype policies
        already decide). Choosing a graph engine (`level == "op"`) means
        switching its rewrite on, with its default lists when `lists` is
        empty, so it always applies.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists`.
        """
        remember_engine(model, self)
        if self.level == "op" or lists != PrecisionLists():
            self.apply(model, lists)

    def check_rewrites(self) -> list:
        """Return rewrites that silently did not happen, warning about them.

        Called by `AMPMonitor` at each epoch end; graph engines that can read
        their rewrite log override it (default: nothing to check).
        """
        return []

    def restore(self) -> None:
        """Put back the global state this engine changed (nothing by default)."""

    def op_types_for_layer(self, layer: keras.layers.Layer) -> tuple:
        """Return the op types a graph engine uses for `layer`."""
        return op_types_for_layer(layer)

    def __repr__(self):
        return f"<{type(self).__name__} name={self.name!r} level={self.level!r}>"
