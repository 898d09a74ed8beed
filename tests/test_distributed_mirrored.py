"""MirroredStrategy over 2 logical CPUs: one replica's overflow; `jit_compile`.

An overflow on one replica only (its half of the batch) is one event, found by
replaying that replica's stash, and denies the layer.

`jit_compile=True` over several replicas in one process: a clear early error.

Keras compiles `strategy.run` over every replica as one XLA computation on one
device, which cannot reach the other devices' variables: with plain Keras
(no keras_amp_plus) the first step fails inside TensorFlow with "Trying to
access resource ... located in device CPU:1 from device CPU:0". Keras's own
`jit_compile="auto"` turns XLA off under tf.distribute. Our monitor raises
in `on_train_begin`, our scaler while the step is traced: before any update.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    from keras_amp_plus.callbacks import AMPMonitor
    from keras_amp_plus.optimizers import LossScaleOptimizer

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras.config.set_dtype_policy("mixed_float16")
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    results = {}
    for case in ("monitor", "scaler", "monitor_no_jit"):
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
            )
            model.compile(
                LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                "mse",
                jit_compile=case != "monitor_no_jit",
            )
        before = [w.numpy().copy() for w in model.weights]
        callbacks = [AMPMonitor(adapt=False)] if "monitor" in case else []
        try:
            model.fit(x, y, batch_size=8, verbose=0, callbacks=callbacks)
            results[case] = {"error": None}
        except ValueError as error:
            results[case] = {"error": str(error)}
        results[case]["unchanged"] = all(
            np.array_equal(b, w.numpy()) for b, w in zip(before, model.weights)
        )
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_jit_compile_over_two_local_replicas_raises_before_any_update():
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    for case, owner in (("monitor", "`jit_compile=True`"), ("scaler", "Loss")):
        error = results[case]["error"]
        assert error is not None and error.startswith(owner), error
        assert "jit_compile=False" in error
        assert "Received: jit_compile=True, devices=" in error
        assert results[case]["unchanged"]
    # Without XLA the same setup trains.
    assert results["monitor_no_jit"] == {"error": None, "unchanged": False}


ONE_REPLICA_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    sys.path.insert(0, {tests!r})
    from conftest import BATCH, overflow_model, regression_data
    from keras_amp_plus.callbacks import AMPMonitor
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = overflow_model("mixed_float16", hot_scale=10.0)
    x, y = regression_data()
    # Replica 1 gets the second half of each global batch: only its share of
    # batch 1 overflows `hot`; replica 0's stays finite.
    x[BATCH + BATCH // 2 : 2 * BATCH] *= 1e4
    monitor = AMPMonitor({log_dir!r}, read_every_steps=4, deny_threshold=1)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0, callbacks=[monitor])
    print(json.dumps({{"events": history.history["overflow_events"],
                      "deny": list(monitor.lists.deny_layers)}}))
    """
)


@pytest.mark.slow
def test_an_overflow_on_one_replica_is_one_event_and_denies_its_layer(tmp_path):
    script = ONE_REPLICA_SCRIPT.format(
        tests=os.path.join(ROOT, "tests"), log_dir=str(tmp_path)
    )
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    with open(os.path.join(tmp_path, "amp_events.jsonl")) as f:
        records = [json.loads(line) for line in f]
    overflows = [r for r in records if r["type"] == "overflow"]
    steps = [r["step"] for r in overflows]
    assert len(steps) == len(set(steps)) == sum(summary["events"])
    forward = [
        (r["step"], r["layers"]) for r in overflows if r["direction"] == "forward"
    ]
    assert forward == [(2, ["hot"])]
    assert summary["deny"] == ["hot"]
    changes = [r for r in records if r["type"] == "list_change"]
    assert [(c["epoch"], c["name"], c["to"]) for c in changes] == [(0, "hot", "deny")]
    # Denied after epoch 0: epoch 1 runs the same batches without an overflow.
    assert summary["events"][1] == 0
