"""Run in a subprocess: MirroredStrategy over 2 logical CPUs (set before TF starts)."""

import json
import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_amp_plus.optimizers import LossScaleOptimizer  # noqa: E402

OVERFLOW_STEPS = (1, 4, 5)  # 0-based steps whose FIRST replica sees an Inf input
NUM_STEPS = 8
GLOBAL_BATCH = 4


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_STEPS * GLOBAL_BATCH, 3)).astype("float32")
    y = rng.normal(size=(NUM_STEPS * GLOBAL_BATCH, 1)).astype("float32")
    for step in OVERFLOW_STEPS:
        x[step * GLOBAL_BATCH, 0] = np.inf  # row 0 of the batch: replica 0 only
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(1, name="dense")]
        )
        optimizer = LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=4.0,
            min_scale=2.0,
            dynamic_growth_steps=2,
            on_min_scale="warn",
        )
        model.compile(optimizer, "mse")
    weights_before = [w.numpy().copy() for w in model.trainable_weights]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    summary = optimizer.overflow_summary()
    summary["total_steps"] = int(optimizer.total_steps.numpy())
    summary["iterations"] = int(optimizer.iterations.numpy())
    summary["events"] = optimizer.read_events(0)
    summary["num_replicas"] = strategy.num_replicas_in_sync
    summary["warnings"] = [str(w.message) for w in caught if "floor" in str(w.message)]
    summary["weights_finite"] = bool(
        all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)
    )
    summary["weights_changed"] = bool(
        any(
            not np.array_equal(a, w.numpy())
            for a, w in zip(weights_before, model.trainable_weights, strict=True)
        )
    )
    json.dump(summary, sys.stdout)


if __name__ == "__main__":
    main()
