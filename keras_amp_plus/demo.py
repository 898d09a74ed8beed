"""`python -m keras_amp_plus demo`: the three-step workflow on a small model.

Trains a tiny transformer block on generated data (no downloads, well under a
minute on two cores) with the three things a user does:

1. swap in `keras_amp_plus.layers.LayerNormalization` and `Swish`;
2. wrap the optimizer in `keras_amp_plus.optimizers.LossScaleOptimizer`;
3. add `keras_amp_plus.callbacks.AMPMonitor(log_dir)` to `fit`, next to
   `keras.callbacks.TensorBoard(log_dir)`.

Under `mixed_float16` the loss scale starts at 2**24 on purpose: the first
steps overflow float16, so the scaler backs off and the monitor has events to
log. bfloat16 has float32's range and will normally log none.
"""

import collections
import json
import os

import keras
import numpy as np

SEQUENCE_LENGTH = 16
FEATURES = 32
CLASSES = 4
SAMPLES = 1024
BATCH_SIZE = 32

# float16 overflows above 65504: starting the scale at 2**24 makes the first
# steps overflow, which shows the scaler backing off and the monitor's events.
FLOAT16_INITIAL_SCALE = 2.0**24


def make_data(samples: int = SAMPLES, seed: int = 0) -> tuple:
    """Return `(inputs, labels)`: random sequences labelled by a fixed teacher.

    The label is the arg-max of a fixed random projection of the sequence mean,
    so there is something to learn and the loss visibly falls.

    Args:
        samples: number of sequences. Defaults to `1024`.
        seed: NumPy seed. Defaults to `0`.

    Example:
    >>> inputs, labels = make_data(samples=8)
    >>> inputs.shape, labels.shape, inputs.dtype.name
    ((8, 16, 32), (8,), 'float32')
    """
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(samples, SEQUENCE_LENGTH, FEATURES)).astype("float32")
    teacher = rng.normal(size=(FEATURES, CLASSES))
    labels = np.argmax(inputs.mean(axis=1) @ teacher, axis=-1).astype("int32")
    return inputs, labels


def build_model() -> keras.Model:
    """Return a one-block transformer classifier built with keras_amp_plus layers.

    Built under the current global dtype policy; the logits layer is float32 so
    the softmax cross-entropy is computed in float32.
    """
    from keras_amp_plus import layers

    inputs = keras.Input((SEQUENCE_LENGTH, FEATURES), name="sequence")
    x = keras.layers.Dense(64, name="embed")(inputs)
    attended = keras.layers.MultiHeadAttention(2, 16, name="attention")(x, x)
    x = layers.LayerNormalization(name="attention_norm")(x + attended)
    hidden = keras.layers.Dense(128, name="expand")(x)
    hidden = layers.Swish(name="swish")(hidden)
    hidden = keras.layers.Dense(64, name="project")(hidden)
    x = layers.LayerNormalization(name="mlp_norm")(x + hidden)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="amp_demo")


def make_optimizer(policy: str):
    """Return Adam wrapped in keras_amp_plus's LossScaleOptimizer.

    bfloat16 has float32's exponent range, so it needs no loss scaling: it gets
    the guard mode (scale fixed at 1, non-finite steps skipped and recorded).
    float16 gets a dynamic scale that starts too high on purpose, so the demo
    shows the scaler backing off in TensorBoard.
    """
    from keras_amp_plus import optimizers

    inner = keras.optimizers.Adam(1e-3)
    if policy == "mixed_float16":
        return optimizers.LossScaleOptimizer(inner, initial_scale=FLOAT16_INITIAL_SCALE)
    return optimizers.LossScaleOptimizer.guard(inner)


def train(log_dir: str, epochs: int = 3, policy: str = "mixed_bfloat16") -> tuple:
    """Train the demo model under `policy`, logging to `log_dir`.

    The global dtype policy is set for the model's construction and restored
    afterwards.

    Args:
        log_dir: TensorBoard log directory (created if missing).
        epochs: number of epochs. Defaults to `3`.
        policy: Keras dtype policy name. Defaults to `"mixed_bfloat16"`.

    Returns:
        `(model, history, monitor)`.
    """
    from keras_amp_plus import callbacks

    if epochs < 1:
        raise ValueError(f"`epochs` must be at least 1. Received: epochs={epochs}")
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        model = build_model()
    finally:
        keras.config.set_dtype_policy(previous_policy)
    model.compile(
        optimizer=make_optimizer(policy),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    inputs, labels = make_data()
    monitor = callbacks.AMPMonitor(log_dir)
    history = model.fit(
        inputs,
        labels,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        validation_split=0.25,
        # AMPMonitor first: the values it adds to `logs` reach TensorBoard.
        callbacks=[monitor, keras.callbacks.TensorBoard(log_dir)],
        verbose=2,
    )
    return model, history, monitor


def events_by_layer(log_dir: str) -> collections.Counter:
    """Count the overflow events AMPMonitor attributed to each layer.

    Reads `<log_dir>/amp_events.jsonl`, the monitor's one-line-per-event log.

    Args:
        log_dir: the monitor's log directory.
    """
    counts = collections.Counter()
    path = os.path.join(log_dir, "amp_events.jsonl")
    if not os.path.exists(path):
        return counts
    with open(path, encoding="utf-8") as events:
        for line in events:
            event = json.loads(line)
            if event.get("type") == "overflow":
                counts.update(event.get("layers", ()))
    return counts


def main(log_dir: str, epochs: int = 3, policy: str = "mixed_bfloat16") -> int:
    """Run the demo, print the overflow summary and how to open TensorBoard.

    Args:
        log_dir: TensorBoard log directory.
        epochs: number of epochs. Defaults to `3`.
        policy: Keras dtype policy name. Defaults to `"mixed_bfloat16"`.

    Returns:
        0 (the process exit code).
    """
    log_dir = os.path.abspath(log_dir)
    print(f"keras_amp_plus demo: policy={policy}, epochs={epochs}")
    model, history, monitor = train(log_dir, epochs=epochs, policy=policy)
    summary = model.optimizer.overflow_summary()
    print()
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    print(
        f"overflow steps: {summary['overflow_count']} "
        f"(NaN {summary['nan_steps']}, Inf {summary['inf_steps']}), "
        f"loss scale now {summary['loss_scale']:g}"
    )
    for layer, count in events_by_layer(log_dir).most_common(3):
        print(f"  AMPMonitor attributed {count} event(s) to layer {layer!r}")
    if monitor.lists.deny_layers:
        print(f"layers moved to float32: {', '.join(monitor.lists.deny_layers)}")
    print(f"TensorBoard logs: {log_dir}")
    print(f"view them with:   tensorboard --logdir {log_dir}")
    return 0
