"""Overflow records: per-variable attribution, NaN vs Inf, the event ring buffer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.optimizers import LossScaleOptimizer

NAN, INF = float("nan"), float("inf")


def three_layer_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="first"),
            keras.layers.Dense(4, name="middle"),
            keras.layers.Dense(1, name="last"),
        ]
    )


def gradients_with(model, bad_layers, bad_value):
    """Finite gradients, except `bad_value` in one entry of the named layers."""
    grads = []
    for variable in model.trainable_variables:
        values = np.full(variable.shape, 0.5, "float32")
        if variable.path.split("/")[-2] in bad_layers:
            values.flat[0] = bad_value
        grads.append(tf.constant(values))
    return grads


def test_only_the_layer_with_non_finite_gradients_is_counted():
    model = three_layer_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=16.0)
    variables = model.trainable_variables
    optimizer.build(variables)
    step = tf.function(lambda grads: optimizer.apply(grads, variables))
    step(gradients_with(model, {"middle"}, INF))
    step(gradients_with(model, {"middle"}, NAN))
    step(gradients_with(model, set(), 0.0))  # finite: counts nothing

    summary = optimizer.overflow_summary()
    assert summary["by_variable"] == {
        "sequential/first/kernel": 0,
        "sequential/first/bias": 0,
        "sequential/middle/kernel": 2,
        "sequential/middle/bias": 2,
        "sequential/last/kernel": 0,
        "sequential/last/bias": 0,
    }
    assert optimizer.tracked_variable_paths() == [v.path for v in variables]
    assert summary["overflow_count"] == 2
    assert (summary["nan_steps"], summary["inf_steps"]) == (1, 1)
    assert summary["last_step_skipped"] is False
    assert summary["loss_scale"] == 4.0


def test_attribution_through_fit_names_the_layer_with_an_overflowing_gradient():
    @tf.custom_gradient
    def inf_weight_gradient(x, weight):
        def grad(upstream):
            return upstream * weight, tf.fill(tf.shape(weight), float("inf"))

        return x * weight, grad

    class Overflowing(keras.layers.Layer):
        def build(self, input_shape):
            self.weight = self.add_weight(shape=(1,), initializer="ones", name="weight")

        def call(self, x):
            return inf_weight_gradient(x, keras.ops.cast(self.weight, x.dtype))

    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, name="dense"), Overflowing()]
    )
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8.0, on_min_scale="ignore"
    )
    model.compile(optimizer, "mse")
    kernel_before = model.layers[0].kernel.numpy()
    x, y = np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)

    by_variable = optimizer.overflow_summary()["by_variable"]
    assert by_variable == {
        "sequential/dense/kernel": 0,
        "sequential/dense/bias": 0,
        "sequential/overflowing/weight": 2,
    }
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernel_before)
    events = optimizer.read_events(0)
    assert [e["variables"] for e in events] == [["sequential/overflowing/weight"]] * 2


def test_ring_buffer_holds_the_last_events_and_wraps_around():
    model = three_layer_model()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=2.0**10,
        event_buffer_size=3,
        on_min_scale="ignore",
    )
    variables = model.trainable_variables
    optimizer.build(variables)
    step = tf.function(lambda grads: optimizer.apply(grads, variables))
    plan = [  # (layers with bad gradients, value); None = a finite step
        ({"first"}, INF),
        None,
        ({"last"}, NAN),
        ({"first", "last"}, INF),
        None,
        ({"middle"}, NAN),
        ({"last"}, INF),
    ]
    for entry in plan:
        bad, value = entry if entry else (set(), 0.0)
        step(gradients_with(model, bad, value))

    paths = {
        name: [f"sequential/{name}/kernel", f"sequential/{name}/bias"]
        for name in ("first", "middle", "last")
    }
    with pytest.warns(UserWarning, match="2 overflow events were overwritten"):
        events = optimizer.read_events(0)
    # 5 overflow events in a 3-slot buffer: events 3, 4, 5 remain.
    assert [e["index"] for e in events] == [3, 4, 5]
    assert [e["step"] for e in events] == [4, 6, 7]
    assert [e["has_nan"] for e in events] == [False, True, False]
    assert [e["variables"] for e in events] == [
        paths["first"] + paths["last"],
        paths["middle"],
        paths["last"],
    ]
    # One growth-free backoff per overflow from 2**10: 2**7 before event 4.
    assert [(e["scale_before"], e["scale_after"]) for e in events] == [
        (2.0**8, 2.0**7),
        (2.0**7, 2.0**6),
        (2.0**6, 2.0**5),
    ]
    assert [e["index"] for e in optimizer.read_events(4)] == [5]
    assert optimizer.read_events(5) == []
    assert optimizer.event_steps.numpy().tolist() == [6, 7, 4]  # slot = (i-1) % 3


def test_skipped_step_leaves_weights_and_inner_slots_untouched():
    model = three_layer_model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    variables = model.trainable_variables
    optimizer.build(variables)
    step = tf.function(lambda grads: optimizer.apply(grads, variables))
    step(gradients_with(model, set(), 0.0))  # give the slots non-zero values

    def snapshot():
        return [
            v.numpy().copy() for v in variables + optimizer.inner_optimizer.variables
        ]

    before = snapshot()
    step(gradients_with(model, {"last"}, NAN))
    after = snapshot()
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)
    assert int(optimizer.last_step_skipped.numpy()) == 1


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"])
def test_guard_skips_a_nan_step_and_applies_the_next_finite_one(policy):
    keras.config.set_dtype_policy(policy)
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    optimizer = LossScaleOptimizer.guard(keras.optimizers.SGD(0.1))
    model.compile(optimizer, "mse")
    x = np.array([[NAN, 1.0], [1.0, 2.0]], "float32")
    y = np.array([[1.0], [5.0]], "float32")
    kernel0, bias0 = (w.numpy().astype("float64") for w in model.trainable_weights)
    inner_before = [v.numpy().copy() for v in optimizer.inner_optimizer.variables]

    model.train_on_batch(x[:1], y[:1])  # NaN input -> NaN gradients: skipped
    assert model.trainable_weights[0].numpy().tolist() == kernel0.tolist()
    for old, v in zip(inner_before, optimizer.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(old, v.numpy())
    summary = optimizer.overflow_summary()
    assert (summary["overflow_count"], summary["nan_steps"]) == (1, 1)
    assert summary["loss_scale"] == 1.0

    model.train_on_batch(x[1:], y[1:])  # finite: applied, unscaled
    xb, yb = x[1:].astype("float64"), y[1:].astype("float64")
    error = xb @ kernel0 + bias0 - yb  # float64 reference of one SGD step
    expected_kernel = kernel0 - 0.1 * 2 * xb.T @ error
    expected_bias = bias0 - 0.1 * 2 * error.sum(axis=0)
    rtol = 1e-2 if policy == "mixed_bfloat16" else 1e-6
    np.testing.assert_allclose(
        model.trainable_weights[0].numpy(), expected_kernel, rtol=rtol
    )
    np.testing.assert_allclose(
        model.trainable_weights[1].numpy(), expected_bias, rtol=rtol
    )
    assert optimizer.overflow_summary()["last_step_skipped"] is False
    assert float(optimizer.dynamic_scale.numpy()) == 1.0
    assert optimizer.scale_loss(3.0) == 3.0


def test_apply_with_a_reordered_subset_maps_gradients_to_their_columns():
    model = three_layer_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    variables = model.trainable_variables
    optimizer.build(variables)
    subset = [variables[5], variables[2]]  # last/bias, middle/kernel
    grads = [tf.constant(np.full(v.shape, 0.5, "float32")) for v in subset]
    grads[1] = tf.tensor_scatter_nd_update(grads[1], [[0, 0]], [float("inf")])
    optimizer.apply(grads, subset)
    counts = optimizer.overflow_summary()["by_variable"]
    assert [path for path, count in counts.items() if count] == [
        "sequential/middle/kernel"
    ]


@pytest.mark.parametrize(
    ("since_count", "error"), [(-1, ValueError), (1.5, TypeError), ("0", TypeError)]
)
def test_read_events_rejects_a_bad_since_count(since_count, error):
    # A negative count must not read as "1 overflow events were overwritten".
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build([keras.Variable([1.0])])
    with pytest.raises(error, match=f"Received: since_count={since_count!r}"):
        optimizer.read_events(since_count)
    assert optimizer.read_events(np.int64(3)) == []  # ahead of the count: nothing


@pytest.mark.parametrize(
    "read",
    [
        lambda o: o.overflow_summary(),
        lambda o: o.tracked_variable_paths(),
        lambda o: o.read_events(0),
    ],
    ids=["overflow_summary", "tracked_variable_paths", "read_events"],
)
def test_reading_records_before_build_raises_a_clear_error(read):
    # Not an AttributeError on a private attribute.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"must be built.*Received: optimizer\.built"):
        read(optimizer)


def test_records_say_whether_the_loss_that_scale_loss_saw_was_finite():
    from keras_amp_plus.optimizers._overflow_record import OverflowRecord

    model = three_layer_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=16.0)
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function
    def step(loss, grads):
        optimizer.scale_loss(loss)
        optimizer.apply(grads, variables)

    step(tf.constant(INF), gradients_with(model, ("first", "middle", "last"), NAN))
    step(tf.constant(1.0), gradients_with(model, ("last",), INF))
    step(tf.constant(1.0), gradients_with(model, (), 0.0))  # applied: no record
    # A step whose loss `scale_loss` never saw (a custom loop).
    optimizer.apply(gradients_with(model, ("first",), INF), variables)

    records = optimizer.read_records(0)
    assert all(isinstance(r, OverflowRecord) for r in records)
    assert [(r.index, r.step, r.loss_finite) for r in records] == [
        (1, 1, False),
        (2, 2, True),
        (3, 4, None),
    ]
    assert [r.scale_before for r in records] == [16.0, 8.0, 4.0]
    assert {path.split("/")[-2] for path in records[1].variables} == {"last"}
    # `read_events` gives the same events as plain dicts.
    assert optimizer.read_events(0) == [r.as_event() for r in records]


def two_blocks_with_the_same_layer_names():
    """Two nested blocks built by one function: their variables' paths repeat."""

    def block(name):
        inputs = keras.Input((3,))
        return keras.Model(
            inputs, keras.layers.Dense(3, name="proj")(inputs), name=name
        )

    inputs = keras.Input((3,))
    hidden = block("b2")(block("b1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def test_repeated_variable_paths_keep_records_apart_and_name_their_layer():
    from keras_amp_plus.callbacks._attribution import LayerIndex

    model = two_blocks_with_the_same_layer_names()
    assert [v.path for v in model.trainable_variables][:4] == [
        "proj/kernel",
        "proj/bias",
        "proj/kernel",
        "proj/bias",
    ]
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer, "mse")
    variables = model.trainable_variables
    optimizer.build(variables)
    grads = [tf.zeros_like(v) for v in variables]
    grads[2] = tf.fill(variables[2].shape, INF)  # block b2's kernel
    optimizer.apply(grads, variables)
    assert optimizer.overflow_summary()["by_variable"] == {
        "proj/kernel": 0,
        "proj/bias": 0,
        "proj/kernel#2": 1,
        "proj/bias#2": 0,
        "out/kernel": 0,
        "out/bias": 0,
    }
    [event] = optimizer.read_events()
    assert event["variables"] == ["proj/kernel#2"]
    index = LayerIndex(model)
    assert index.layers_of_variables(event["variables"]) == ["b2/proj"]
