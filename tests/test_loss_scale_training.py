"""Real training with `fit`, and exact counters under MirroredStrategy.

This file is also the MirroredStrategy worker: run as a script it configures
2 logical CPUs before TensorFlow starts its devices, which cannot be undone
inside the pytest process.
"""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.optimizers import LossScaleOptimizer


def regression_data(seed=0, n=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1))
    y = (np.tanh(x @ w) + 0.1 * x[:, :1] ** 2).astype("float32")
    return x, y


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_fit_trains_a_small_model(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    inner = keras.optimizers.Adam(3e-3)
    if policy == "mixed_bfloat16":
        optimizer = LossScaleOptimizer.guard(inner)
    else:
        optimizer = LossScaleOptimizer(inner, dynamic_growth_steps=20)
    model.compile(optimizer, "mse")
    # compile must not wrap our scaler a second time under mixed_float16.
    assert model.optimizer is optimizer
    x, y = regression_data()
    history = model.fit(x, y, batch_size=32, epochs=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0]
    summary = optimizer.overflow_summary()
    assert int(optimizer.total_steps.numpy()) == 8 * 8
    assert int(optimizer.iterations.numpy()) == 64 - summary["overflow_count"]
    if policy == "mixed_float16":
        # 2**15 * loss gradients fit float16 here: the scale grew 3 times.
        assert summary["loss_scale"] >= 2.0**15
    else:
        assert summary["overflow_count"] == 0


def test_learning_rate_callbacks_reach_the_inner_optimizer():
    # ReduceLROnPlateau and LearningRateScheduler set `model.optimizer
    # .learning_rate`: through the scaler, the inner optimizer's must change.
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1))
    model.compile(optimizer, "mse")
    x, y = regression_data(n=64)
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9, verbose=0
    )  # no epoch after the first improves by 1e9: halved at epochs 1 and 2
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[plateau])
    assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(0.025)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch: 1e-3 * (epoch + 1))
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[schedule])
    assert history.history["learning_rate"] == pytest.approx([1e-3, 2e-3])
    assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(2e-3)


def test_mixed_float16_backs_off_from_an_overflowing_scale_and_trains():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Embedding(50, 8),  # sparse (IndexedSlices) gradients
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0**24, on_min_scale="raise"
    )
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(256, 8))
    y = (x[:, :1] / 25.0 - 1.0).astype("float32")
    history = model.fit(x, y, batch_size=32, epochs=6, verbose=0)
    summary = optimizer.overflow_summary()
    # 2**24 * loss overflows float16 (max 65504): the first steps are skipped.
    assert summary["overflow_count"] >= 3
    assert summary["loss_scale"] < 2.0**24
    assert int(optimizer.iterations.numpy()) == 48 - summary["overflow_count"]
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)
    losses = history.history["loss"]
    assert losses[-1] < 0.2 * losses[0]


# 0-based step -> row of its batch holding an Inf input. Rows 0-1 go to the first
# replica, rows 2-3 to the second: Keras's own scaler takes the first replica's
# finiteness only, so it misses step 4 and applies NaN gradients.
OVERFLOW_ROWS = {1: 0, 4: 3, 5: 1}
OVERFLOW_STEPS = tuple(OVERFLOW_ROWS)
NUM_STEPS = 8
GLOBAL_BATCH = 4


def run_mirrored_worker():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_STEPS * GLOBAL_BATCH, 3)).astype("float32")
    y = rng.normal(size=(NUM_STEPS * GLOBAL_BATCH, 1)).astype("float32")
    for step, row in OVERFLOW_ROWS.items():
        x[step * GLOBAL_BATCH + row, 0] = np.inf  # one replica only
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")])
        optimizer = LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=4.0,
            min_scale=2.0,
            dynamic_growth_steps=2,
        )
        model.compile(optimizer, "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=1, verbose=0)
    result = optimizer.overflow_summary()
    result.update(
        total_steps=int(optimizer.total_steps.numpy()),
        iterations=int(optimizer.iterations.numpy()),
        events=optimizer.read_events(0),
        num_replicas=strategy.num_replicas_in_sync,
        floor_warnings=sum("floor" in str(w.message) for w in caught),
        weights_finite=all(np.isfinite(w.numpy()).all() for w in model.weights),
    )
    json.dump(result, sys.stdout)


def test_mirrored_strategy_counts_each_overflow_step_once():
    completed = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["num_replicas"] == 2
    assert result["overflow_count"] == 3  # once per step, not once per replica
    assert (result["inf_steps"], result["nan_steps"]) == (3, 0)
    assert result["total_steps"] == NUM_STEPS
    assert result["iterations"] == NUM_STEPS - 3
    assert result["by_variable"] == {"sequential/d/kernel": 3, "sequential/d/bias": 3}
    assert [e["step"] for e in result["events"]] == [s + 1 for s in OVERFLOW_STEPS]
    # 4 -> 2 at step 2; regrown to 4 after 2 finite steps; 4 -> 2; at the floor.
    assert [[e["scale_before"], e["scale_after"]] for e in result["events"]] == [
        [4.0, 2.0],
        [4.0, 2.0],
        [2.0, 2.0],
    ]
    assert result["floor_warnings"] == 1
    assert result["loss_scale"] == 4.0
    assert result["weights_finite"]


if __name__ == "__main__":
    run_mirrored_worker()


def test_apply_of_no_gradients_is_a_no_op_and_a_short_list_is_named():
    # As Keras's optimizers: an empty list changes nothing, counts no step.
    variables = [tf.Variable([1.0, 2.0]), tf.Variable(3.0)]
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(variables)
    optimizer.apply([], [])
    assert int(optimizer.total_steps.numpy()) == 0
    assert int(optimizer.iterations.numpy()) == 0
    with pytest.raises(ValueError, match=r"got 1 for the 2 variables the optimizer"):
        optimizer.apply([tf.ones(2)])
    assert int(optimizer.total_steps.numpy()) == 0  # raised before counting
    np.testing.assert_array_equal(variables[0].numpy(), [1.0, 2.0])


class CustomStepNet(keras.Model):
    """Keras 3's custom `train_step` pattern, with or without `scale_loss`."""

    def __init__(self, scales_loss, **kwargs):
        super().__init__(**kwargs)
        self.scales_loss = scales_loss
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss) if self.scales_loss else loss
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("scales_loss", [False, True])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_gradients_of_a_loss_scale_loss_never_saw_are_said_once(
    scales_loss, run_eagerly
):
    # `apply` divides by the scale: gradients of the unscaled loss would move
    # the weights 32768 times too little without any other sign.
    x, y = regression_data()
    model = CustomStepNet(scales_loss)
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse", run_eagerly=run_eagerly
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    said = [w for w in caught if "scale_loss(loss)" in str(w.message)]
    assert len(said) == (0 if scales_loss else 1)
    if said:
        assert "(32768 at the start)" in str(said[0].message)
        assert "Received: gradients of a loss" in str(said[0].message)


def test_a_loop_scaling_eagerly_and_applying_in_a_function_is_not_warned():
    variable = tf.Variable([1.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with tf.GradientTape() as tape:
        scaled = optimizer.scale_loss(tf.reduce_sum(variable * 2.0))
    grads = tape.gradient(scaled, [variable])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf.function(lambda: optimizer.apply(grads, [variable]))()
    assert not [w for w in caught if "scale_loss(loss)" in str(w.message)]
    np.testing.assert_allclose(variable.numpy(), [0.8])


def test_keras_train_step_and_the_guard_are_not_said_to_skip_scale_loss():
    x, y = regression_data()
    for optimizer, model in (
        (
            LossScaleOptimizer(keras.optimizers.SGD(0.01)),
            keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]),
        ),
        (LossScaleOptimizer.guard(keras.optimizers.SGD(0.01)), CustomStepNet(False)),
    ):
        model.compile(optimizer, "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        assert not [w for w in caught if "scale_loss(loss)" in str(w.message)]
