"""Does `jit_compile=True` pay on this CPU? A short measured training step.

XLA's CPU backend fuses elementwise ops and reductions, but its matrix
products and its bfloat16 code differ from TensorFlow's oneDNN kernels, so
whether a whole-model XLA compile speeds up training depends on the CPU and
the policy: on some CPUs it speeds up every model, on others it slows
bfloat16 training down (see `benchmarks/training.py`). The doctor therefore
measures: two copies of one small model (dense / LayerNormalization blocks,
the layers of a transformer's feed-forward half) train on the same batch,
compiled with `jit_compile` off and on, called interleaved after a warm-up
(tracing and compiling are not timed), medians of process CPU time.
"""

import statistics
import time

import numpy as np

# Sized like a small transformer's blocks: XLA's saving of per-op overhead
# dominates tinier models. On an Intel Xeon Ice Lake (float32) 128 features x
# 32 positions measured 1.14-1.18x with jit_compile, recommending it, where a
# transformer and a CNN trained 0.95-1.02x as fast with it
# (`benchmarks/training.py`); 256 x 64 measured 1.00-1.02x, and 2.7-2.9x in
# mixed_bfloat16 (the transformer: 2.3-2.4x). Those were measured with the
# residual summed by `+` (Keras 3 promotes the first block's sum to float32;
# the `Add` layer now sums in the compute dtype).
WIDTH, LENGTH, BATCH, BLOCKS = 256, 64, 16, 2
MIN_ROUNDS = 3


def _model(keras, layer_norm):
    """Return a small model of dense / layer-norm residual blocks."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH, WIDTH))
    x = inputs
    for _ in range(BLOCKS):
        hidden = keras.layers.Dense(4 * WIDTH, activation="relu")(x)
        # An `Add` layer casts both to the policy's compute dtype; tf.keras 2
        # does not promote `+` of a float32 input and a bfloat16 output.
        residual = keras.layers.Add()([x, keras.layers.Dense(WIDTH)(hidden)])
        x = layer_norm()(residual)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model(inputs, outputs)


def probe_jit_speedup(seconds: float = 2.0, policy: str = "mixed_bfloat16") -> dict:
    """Time a training step with `jit_compile` off and on under `policy`.

    The global dtype policy is restored afterwards.

    Args:
        seconds: wall-time budget of the timed rounds (warm-up and XLA
            compilation come on top). Defaults to `2.0`.
        policy: the Keras dtype policy to train under. Defaults to
            `"mixed_bfloat16"`.

    Returns:
        `{"policy", "graph_ms", "jit_ms", "speedup", "rounds"}` where
        `speedup` is the graph step's CPU time over the jit step's (above 1:
        jit pays), or `{"policy", "error"}` when a step could not run.
    """
    import keras

    from keras_amp_plus import _compat, layers

    previous = _compat.global_policy()
    _compat.set_global_policy(policy)
    try:
        models = {
            jit: _model(keras, layers.LayerNormalization) for jit in (False, True)
        }
    except Exception as error:  # report, do not crash the doctor
        return {"policy": policy, "error": f"{type(error).__name__}: {error}"[:200]}
    finally:
        _compat.set_global_policy(previous)
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, (BATCH, LENGTH, WIDTH)).astype("float32")
    y = rng.normal(0.0, 1.0, (BATCH, 1)).astype("float32")
    try:
        for jit, model in models.items():
            model.compile(optimizer="adam", loss="mse", jit_compile=jit)
            model.train_on_batch(x, y)  # trace and compile
            model.train_on_batch(x, y)
        times = {jit: [] for jit in models}
        deadline = time.monotonic() + seconds
        while len(times[True]) < MIN_ROUNDS or time.monotonic() < deadline:
            for jit, model in models.items():
                start = time.process_time()
                model.train_on_batch(x, y)
                times[jit].append(time.process_time() - start)
    except Exception as error:  # report, do not crash the doctor
        return {"policy": policy, "error": f"{type(error).__name__}: {error}"[:200]}
    graph, jit = (statistics.median(times[key]) for key in (False, True))
    return {
        "policy": policy,
        "graph_ms": 1e3 * graph,
        "jit_ms": 1e3 * jit,
        "speedup": graph / jit,
        "rounds": len(times[True]),
    }
