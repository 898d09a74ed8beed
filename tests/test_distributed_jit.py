"""`jit_compile=True` over several replicas in one process: a clear early error.

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
