"""Training on several workers: who writes, and one decision for all of them.

Under `tf.distribute.MultiWorkerMirroredStrategy` every worker runs the same
`fit` with its own `AMPMonitor`. The in-graph overflow decision is already
all-reduced over every replica of every worker (the scaler's and the
recorder's collectives), so each worker counts the same steps. What each
worker computes on its own host is the attribution of a forward overflow: it
replays its own stashed batch, and only the workers whose data overflowed
find the layer. `agree_on_layers` makes that attribution the union over the
workers, so every worker feeds the adaptation rule the same evidence and
moves the same layers at the same epoch.

Only the chief writes TensorBoard summaries and `amp_events.jsonl` (Keras's
multi-worker guidance: other workers write to a temporary place or nowhere);
every worker reads the chief's `amp_state.json` when a job resumes.

Keras 3's `fit` fails under a multi-worker strategy before and after the
first step; `prepare_multi_worker_fit` works around both.
"""

import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._arguments import require_model
from keras_amp_plus.callbacks._attribution import BAD_DATA


def is_chief(strategy) -> bool:
    """Return True when this process writes the shared logs.

    The chief of a `MultiWorkerMirroredStrategy` cluster (task type "chief",
    or worker 0 when there is none); True for a single-worker strategy.
    """
    return bool(strategy.extended.should_save_summary)


def is_multi_worker(strategy) -> bool:
    """Return True when the strategy's replicas span more than this process."""
    return strategy.num_replicas_in_sync > local_replicas(strategy)


def any_across_workers(strategy, flags):
    """Return the element-wise OR of a boolean array over every worker.

    Every worker must call this at the same point with an array of the same
    shape (a collective); a single-worker strategy returns `flags` as is.
    """
    flags = np.asarray(flags, dtype=bool)
    if not is_multi_worker(strategy) or flags.size == 0:
        return flags

    @tf.function
    def summed(local):
        # Each replica contributes the worker's flags; > 0 is "any worker".
        per_replica = strategy.run(tf.identity, args=(local,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return summed(tf.constant(flags.astype(np.int32))).numpy() > 0


def chief_values(strategy, values):
    """Return the chief's `values` (a float array) on every worker (a collective).

    Example:
    >>> import tensorflow as tf
    >>> chief_values(tf.distribute.get_strategy(), [1, 2])
    array([1., 2.])
    """
    values = np.asarray(values, dtype=np.float64)
    if not is_multi_worker(strategy):
        return values
    # Each local replica contributes a share of the chief's values, the
    # other workers' replicas zeros: the sum is the chief's values.
    share = values / local_replicas(strategy) if is_chief(strategy) else 0 * values

    @tf.function
    def summed(local):
        per_replica = strategy.run(tf.identity, args=(local,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return np.round(summed(tf.constant(share)).numpy())


def check_same_record(strategy, fingerprint, log_dir) -> None:
    """Raise on every worker unless all found the chief's record (a collective).

    Each worker reads the monitor's state from `log_dir`; workers that read
    different files (a `log_dir` per worker) would keep different lists and
    skip different steps, then wait for each other forever.

    Args:
        strategy: the model's distribution strategy.
        fingerprint: numbers that describe the record this worker continues
            (integers below 2**32), in the same order on every worker.
        log_dir: this worker's `log_dir`, for the message.
    """
    if not is_multi_worker(strategy):
        return
    fingerprint = np.asarray(fingerprint, dtype=np.float64)
    differs = not np.array_equal(chief_values(strategy, fingerprint), fingerprint)
    if any_across_workers(strategy, [differs])[0]:
        raise ValueError(
            "AMPMonitor's workers found different records in their `log_dir`: "
            "each worker reads the monitor's state (lists, counters, the run "
            "it continues) from there, so every worker must be given the "
            "same `log_dir`, on a file system they share. Received: "
            f"log_dir={log_dir!r} on this worker"
        )


def agree_on_layers(strategy, events, layer_names):
    """Give every forward event the layers any worker's replay found.

    A forward event no worker found a layer for, but whose batch held Inf or
    NaN on some worker, says so on every worker: bad data, not an overflow
    the replay could not reproduce.

    Args:
        strategy: the model's distribution strategy.
        events: this worker's attributed events of one read (the same steps
            on every worker); changed in place.
        layer_names: every attributable layer name, in the same order on
            every worker.
    """
    if not is_multi_worker(strategy) or not events:
        return events
    position = {name: i for i, name in enumerate(layer_names)}
    bad_data_column = len(layer_names)
    found = np.zeros((len(events), len(layer_names) + 1), dtype=bool)
    for row, event in enumerate(events):
        if event["direction"] == "forward":
            for layer in event["layers"]:
                if layer in position:
                    found[row, position[layer]] = True
            found[row, bad_data_column] = _replay_found_bad_data(event)
    agreed = any_across_workers(strategy, found)
    for row, event in enumerate(events):
        if event["direction"] != "forward":
            continue
        layers = [
            name
            for name, hit in zip(
                layer_names, agreed[row, :bad_data_column], strict=True
            )
            if hit
        ]
        if layers != event["layers"]:
            if not event["layers"]:
                event["evidence"] = "replay of another worker's batch"
            event["layers"] = layers
        # A worker that saw bad data while another found a layer takes the
        # layer: the evidence that moves lists.
        elif (
            not layers
            and agreed[row, bad_data_column]
            and not _replay_found_bad_data(event)
        ):
            event["evidence"] = f"replay of another worker's batch: {BAD_DATA}"
    return events


def _replay_found_bad_data(event) -> bool:
    """Return True when this worker's replay found Inf/NaN in the batch."""
    return f": {BAD_DATA}" in event.get("evidence", "")


def local_replicas(strategy) -> int:
    """Return the number of replicas this process runs."""
    if strategy.num_replicas_in_sync == 1:
        return 1  # the default strategy has no `worker_devices`
    return len(strategy.extended.worker_devices)


def allows_nested_xla_step(strategy) -> bool:
    """Return True when the step may call a nested XLA function that trains.

    Without a strategy or on one device. Under `MirroredStrategy` (even with
    one replica) the optimizer updates its variables in a `merge_call`, which
    TF refuses inside a nested `tf.function` ("merge_call called while
    defining a new graph or a tf.function").
    """
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return True
    with strategy.scope():
        return not tf.distribute.has_strategy()


def jit_compile_problem(strategy) -> str | None:
    """Return why a `jit_compile=True` step cannot train here, or None.

    - Several replicas in one process: Keras compiles the whole step,
      `strategy.run` over every replica included, as one XLA computation
      placed on one device, which cannot reach the other devices' variables
      ("Trying to access resource ... located in device .../device:CPU:1 from
      device .../device:CPU:0", TensorFlow's XLA known issue "tf.Variable on a
      different device").
    - Several workers on CPUs: TensorFlow's XLA has no CPU collectives
      ("Collectives are not yet implemented for CPU devices when compiling
      with XLA").

    Keras's own `jit_compile="auto"` turns XLA off under `tf.distribute`.
    """
    replicas = local_replicas(strategy)
    if replicas > 1:
        return (
            f"{type(strategy).__name__} runs {replicas} replicas in this process "
            "and Keras compiles the step of every replica into one XLA "
            "computation on one device, which cannot reach the other devices' "
            "variables (the step would fail with 'Trying to access resource ... "
            "from device ...')"
        )
    if is_multi_worker(strategy):
        devices = strategy.extended.worker_devices
        if all("CPU" in device.upper() for device in devices):
            return (
                f"the {strategy.num_replicas_in_sync} replicas are on several "
                "workers on CPUs and TensorFlow's XLA has no collectives for CPU "
                "devices (the step would fail with 'Collectives are not yet "
                "implemented for CPU devices when compiling with XLA')"
            )
    return None


def _unsupported_strategies() -> tuple:
    """Return the tf.distribute strategies whose variables the monitor cannot keep.

    Its records are per-replica variables written inside the step; under a
    strategy that keeps variables on another device (central storage, a
    parameter server, a TPU) they become aggregating variables whose
    updates need a `merge_call` a step's `tf.cond` cannot make.
    """
    names = ("CentralStorageStrategy", "ParameterServerStrategy", "TPUStrategy")
    found = []
    for namespace in (tf.distribute, tf.distribute.experimental):
        found += [getattr(namespace, n) for n in names if hasattr(namespace, n)]
    return tuple(found)


def check_strategy(model) -> None:
    """Raise a clear error under a strategy the monitor cannot train with.

    Raised in `on_train_begin`, before any step. The monitor runs with no
    strategy, `OneDeviceStrategy`, `MirroredStrategy` and
    `MultiWorkerMirroredStrategy`.

    Args:
        model: the compiled model.
    """
    strategy = model.distribute_strategy
    if isinstance(strategy, _unsupported_strategies()):
        raise ValueError(
            f"AMPMonitor cannot train under `{type(strategy).__name__}`: it "
            "records each step's events in per-replica variables, which this "
            "strategy keeps on another device, where a step cannot update "
            "them. Use `tf.distribute.MirroredStrategy` (one machine) or "
            "`tf.distribute.MultiWorkerMirroredStrategy` (several), or train "
            "without AMPMonitor (our `LossScaleOptimizer` works there). "
            f"Received: strategy={type(strategy).__name__}"
        )


def check_jit_compile(model) -> None:
    """Raise a clear error when the model's `jit_compile=True` cannot train here.

    See `jit_compile_problem`; raised in `on_train_begin`, before any step.

    Args:
        model: the compiled model.
    """
    if not _compat.jit_compile_on(model):
        return
    strategy = model.distribute_strategy
    problem = jit_compile_problem(strategy)
    if problem is not None:
        raise ValueError(
            f"`jit_compile=True` cannot train here: {problem}. "
            f"{_compat.JIT_COMPILE_OFF_ADVICE}. Received: "
            f"jit_compile={model.jit_compile!r}, devices="
            f"{list(strategy.extended.worker_devices)}"
        )


def prepare_multi_worker_fit(model) -> None:
    """Let `model.fit` run under `tf.distribute.MultiWorkerMirroredStrategy`.

    Keras 3's TensorFlow trainer fails there with more than one worker, with
    or without `AMPMonitor`: it builds the model from the first batch with
    `strategy.reduce` over an `(x, y)` tuple ("Attempt to convert a value
    (PerReplica...)"), and it averages each step's scalar logs with
    `strategy.reduce(..., axis=0)` ("Invalid reduction dimension 0 for input
    with 0 dimensions"), in training, validation and `evaluate`. Call this
    once after creating the model in `strategy.scope()` and before `fit`;
    it only changes that model instance (the first local replica's batch
    builds it; the logs gain a leading axis of size 1, which the average
    removes again). It does nothing when the
    model's strategy has a single worker.

    Args:
        model: a Keras model created under the strategy's scope.

    Example:
    >>> import keras
    >>> from keras_amp_plus.callbacks import prepare_multi_worker_fit
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> prepare_multi_worker_fit(model)  # one worker here: nothing to do
    """
    require_model(model, "prepare_multi_worker_fit")
    strategy = model.distribute_strategy
    if not is_multi_worker(strategy):
        return
    if not _compat.build_from_first_replica(model, strategy):
        return  # Keras 2 (the ITEX stack): another trainer, not tested there
    # Validation (`fit(validation_data=...)`) and `evaluate` reduce their
    # logs the same way.
    for name in ("train_step", "test_step"):
        setattr(model, name, _with_vector_logs(getattr(model, name)))


def _with_vector_logs(step):
    def step_with_vector_logs(data):
        return tf.nest.map_structure(_as_vector, step(data))

    return step_with_vector_logs


def _as_vector(value):
    if isinstance(value, tf.Tensor | tf.Variable) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value
