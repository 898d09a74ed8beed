"""MirroredStrategy over 2 logical CPUs: overflow counts, attribution, `jit_compile`.

Every overflow step is one event (not one per replica) and denies its layer,
also when only one replica's share of the batch overflows (found by replaying
that replica's stash).

`jit_compile=True` on one replica trains; over several replicas in one
process: a clear early error.
Keras compiles `strategy.run` over every replica as one XLA computation on one
device, which cannot reach the other devices' variables: with plain Keras
(no keras_amp_plus) the first step fails inside TensorFlow with "Trying to
access resource ... located in device CPU:1 from device CPU:0". Keras's own
`jit_compile="auto"` turns XLA off under tf.distribute. Our monitor raises
in `on_train_begin`, our scaler while the step is traced: before any update.
"""

import json
import os

import pytest
from conftest import STEPS_PER_EPOCH, read_jsonl, run_on_two_cpus

pytestmark = pytest.mark.slow


def test_one_event_per_overflow_step_and_the_layer_denied(tmp_path):
    summary = run_on_two_cpus(
        f"""
        from conftest import overflow_model, train
        from keras_amp_plus.callbacks import AMPMonitor
        with strategy.scope():
            model = overflow_model("mixed_float16")
        monitor = AMPMonitor({str(tmp_path)!r}, read_every_steps=4, patience=50)
        history = train(model, [monitor], epochs=2)
        print(json.dumps({{"events": history.history["overflow_events"],
                          "deny": list(monitor.lists.deny_layers)}}))
        """
    )
    # One event per overflow step (not per replica), `hot` denied.
    assert summary["events"][0] == STEPS_PER_EPOCH
    assert summary["deny"] == ["hot"]
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    first = [r["step"] for r in events if r["epoch"] == 0]
    assert first == list(range(1, STEPS_PER_EPOCH + 1))


def test_an_overflow_on_one_replica_is_one_event_and_denies_its_layer(tmp_path):
    summary = run_on_two_cpus(
        f"""
        from conftest import BATCH, overflow_model, regression_data
        from keras_amp_plus.callbacks import AMPMonitor
        from keras_amp_plus.optimizers import _finite_flags
        # A model this small takes the exact finite check alone: here each
        # replica reads its sums first, as a large model's replicas do.
        _finite_flags.SUMS_MIN_ELEMENTS = 0
        with strategy.scope():
            model = overflow_model("mixed_float16", hot_scale=10.0)
        x, y = regression_data()
        # Replica 1 gets the second half of each global batch: only its share
        # of batch 1 overflows `hot`; replica 0's stays finite.
        x[BATCH + BATCH // 2 : 2 * BATCH] *= 1e4
        monitor = AMPMonitor({str(tmp_path)!r}, read_every_steps=4, deny_threshold=1)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0, callbacks=[monitor])
        print(json.dumps({{"events": history.history["overflow_events"],
                          "deny": list(monitor.lists.deny_layers)}}))
        """
    )
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


def test_jit_compile_on_one_mirrored_replica_counts_and_denies(tmp_path):
    # One replica per machine (one GPU) compiles with XLA in Keras; the
    # optimizer's merge_call keeps the whole step, recording included, in XLA.
    summary = run_on_two_cpus(
        f"""
        from conftest import overflow_model, train
        from keras_amp_plus.callbacks import AMPMonitor
        one_replica = tf.distribute.MirroredStrategy(["/cpu:0"])
        with one_replica.scope():
            model = overflow_model("mixed_float16", on_min_scale="ignore")
            model.compile(model.optimizer, loss="mse", jit_compile=True)
        monitor = AMPMonitor({str(tmp_path)!r}, read_every_steps=4, patience=50)
        history = train(model, [monitor], epochs=2)

        # A second fit with the same monitor reuses the traced step.
        traces = []
        model_train_step = model.train_step

        def counted_train_step(data):
            traces.append(1)
            return model_train_step(data)

        model.train_step = counted_train_step
        steady = AMPMonitor(adapt=False)
        train(model, [steady], epochs=1)
        first_traces = len(traces)
        train(model, [steady], epochs=1)
        print(json.dumps({{"events": history.history["overflow_events"],
                          "deny": list(monitor.lists.deny_layers),
                          "jit": model.jit_compile,
                          "retraced": len(traces) > first_traces}}))
        """
    )
    assert summary["events"][0] == STEPS_PER_EPOCH
    assert summary["deny"] == ["hot"]
    assert summary["jit"] is True
    assert summary["retraced"] is False


def test_jit_compile_over_two_local_replicas_raises_before_any_update():
    results = run_on_two_cpus(
        """
        import numpy as np
        import keras
        from keras_amp_plus.callbacks import AMPMonitor
        from keras_amp_plus.optimizers import LossScaleOptimizer

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
    for case, owner in (("monitor", "`jit_compile=True`"), ("scaler", "Loss")):
        error = results[case]["error"]
        assert error is not None and error.startswith(owner), error
        assert "jit_compile=False" in error
        assert "Received: jit_compile=True, devices=" in error
        assert results[case]["unchanged"]
    # Without XLA the same setup trains.
    assert results["monitor_no_jit"] == {"error": None, "unchanged": False}


def test_central_storage_is_refused_before_the_first_step():
    # Its per-replica variables become aggregating ones, which a step's
    # `tf.cond` cannot update: a clear error first, the weights untouched.
    results = run_on_two_cpus(
        """
        import numpy as np
        import keras
        from keras_amp_plus.callbacks import AMPMonitor
        from keras_amp_plus.optimizers import LossScaleOptimizer

        central = tf.distribute.experimental.CentralStorageStrategy()
        with central.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(LossScaleOptimizer.guard(keras.optimizers.SGD()), "mse")
        x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
        before = [w.numpy().copy() for w in model.weights]
        try:
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[AMPMonitor()])
            error = None
        except ValueError as caught:
            error = str(caught)
        after = [w.numpy() for w in model.weights]
        unchanged = all(np.array_equal(b, a) for b, a in zip(before, after))
        model.fit(x, y, batch_size=8, verbose=0)  # the scaler alone trains there
        print(json.dumps({"error": error, "unchanged": unchanged}))
        """
    )
    assert results["error"].startswith("AMPMonitor cannot train under")
    assert "Received: strategy=CentralStorageStrategy" in results["error"]
    assert results["unchanged"]
