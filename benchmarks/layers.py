"""Benchmark keras_amp_plus.layers against their Keras counterparts.

Under the `mixed_bfloat16` policy, for each layer pair:

- time: one forward + backward step (gradients w.r.t. the input and every
  weight, upstream gradient given), each wrapped in its own `tf.function` and
  warmed up first; process CPU time (`time.process_time()`, all threads) of
  each call, ours and Keras's interleaved call by call, median of `--reps`;
- error: max absolute error of the output and of the input gradient against a
  float64 NumPy reference, on the same (bfloat16) input and weights, for
  N(0, 1) inputs and for N(1000, 1) inputs ("far");
- peak memory: TensorFlow's CPU allocator peak during one step
  (`tf.config.experimental.get_memory_info("CPU:0")["peak"]` after
  `reset_memory_stats`) minus what was allocated before the step (the inputs
  and weights). It counts every tensor TensorFlow allocates, including the
  ones kept for the backward pass; oneDNN scratch memory outside the TF
  allocator is not seen.

Usage: python benchmarks/layers.py [--quick] [--reps N] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from keras_amp_plus import layers

RESULTS = pathlib.Path(__file__).parent / "results"
TARGETS = {  # max time ratio, and whether peak memory must not exceed Keras's
    "LayerNormalization": (0.8, False),
    "InstanceNormalization": (0.8, False),
    "Swish": (1.0, True),
}


def normalization_reference(x, upstream, gamma, beta, stat_axes, epsilon=1e-3):
    """Float64 output and input gradient of a normalization layer."""
    mean = x.mean(axis=stat_axes, keepdims=True)
    inverse_stddev = 1.0 / np.sqrt(x.var(axis=stat_axes, keepdims=True) + epsilon)
    normalized = (x - mean) * inverse_stddev
    scaled = upstream * gamma
    x_grad = inverse_stddev * (
        scaled
        - scaled.mean(axis=stat_axes, keepdims=True)
        - normalized * (scaled * normalized).mean(axis=stat_axes, keepdims=True)
    )
    return normalized * gamma + beta, x_grad


def swish_reference(x, upstream, *_):
    """Float64 output and input gradient of swish (beta = 1)."""
    sigmoid = 1.0 / (1.0 + np.exp(-x))
    return x * sigmoid, upstream * sigmoid * (1.0 + x * (1.0 - sigmoid))


def cases(quick):
    """Yield (name, ours, keras_layer, shape, reference, stat_axes, keras_name)."""
    ln_shape = (256, 128) if quick else (8192, 1024)
    in_shape = (4, 16, 16, 32) if quick else (32, 64, 64, 128)
    swish_shape = (256, 256) if quick else (8192, 4096)
    yield (
        "LayerNormalization",
        layers.LayerNormalization(),
        keras.layers.LayerNormalization(),
        ln_shape,
        normalization_reference,
        (1,),
        "LayerNormalization",
    )
    yield (
        "InstanceNormalization",
        layers.InstanceNormalization(),
        keras.layers.GroupNormalization(groups=-1),
        in_shape,
        normalization_reference,
        (1, 2),
        "GroupNormalization(groups=-1)",
    )
    yield (
        "Swish",
        layers.Swish(),
        keras.layers.Activation("swish"),
        swish_shape,
        swish_reference,
        None,
        'Activation("swish")',
    )


def make_step(layer):
    """Return a tf.function running forward + backward through `layer`."""

    @tf.function
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        sources = [x, *layer.trainable_weights]
        return outputs, tape.gradient(outputs, sources, output_gradients=upstream)

    return step


def random_inputs(shape, mean, seed):
    rng = np.random.default_rng(seed)
    x = tf.cast(tf.constant(rng.normal(mean, 1.0, shape), tf.float32), tf.bfloat16)
    upstream = tf.cast(
        tf.constant(rng.normal(0.0, 1.0, shape), tf.float32), tf.bfloat16
    )
    return x, upstream


def max_errors(step, x, upstream, reference, gamma, beta, stat_axes):
    """Max |output - ref| and max |input gradient - ref| against float64."""
    outputs, grads = step(x, upstream)
    as64 = lambda t: np.asarray(tf.cast(t, tf.float64))  # noqa: E731
    ref_outputs, ref_grad = reference(as64(x), as64(upstream), gamma, beta, stat_axes)
    return (
        float(np.abs(as64(outputs) - ref_outputs).max()),
        float(np.abs(as64(grads[0]) - ref_grad).max()),
    )


def peak_step_bytes(step, x, upstream):
    """TF CPU allocator peak during one step, above what was live before it."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    result = step(x, upstream)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del result
    return peak - before


def interleaved_cpu_times(steps, x, upstream, reps):
    """Process CPU seconds of each step, calls interleaved, `reps` each."""
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.process_time()
            step(x, upstream)
            times[name].append(time.process_time() - start)
    return times


def copy_random_weights(source, target, param_shape, seed=3):
    """Give both layers the same random float32 weights; return them as float64."""
    rng = np.random.default_rng(seed)
    values = [rng.normal(1.0 - i, 0.3, w.shape) for i, w in enumerate(source.weights)]
    for weight, value in zip(source.weights, values, strict=True):
        weight.assign(value)
    target.set_weights(source.get_weights())
    if not values:
        return 1.0, 0.0
    return [np.reshape(np.asarray(w, np.float64), param_shape) for w in source.weights]


def run_case(case, reps):
    name, ours, theirs, shape, reference, stat_axes, keras_name = case
    x, upstream = random_inputs(shape, 0.0, seed=0)
    for layer in (ours, theirs):
        layer.build(shape)
    param_shape = [1] * (len(shape) - 1) + [shape[-1]]
    gamma, beta = copy_random_weights(ours, theirs, param_shape)
    steps = {"ours": make_step(ours), "keras": make_step(theirs)}
    for step in steps.values():  # warm up: trace, compile, first allocations
        for _ in range(2):
            step(x, upstream)
    row = {"layer": name, "keras_layer": keras_name, "shape": list(shape)}
    times = interleaved_cpu_times(steps, x, upstream, reps)
    far_x, far_upstream = random_inputs(shape, 1000.0, seed=1)
    for who, step in steps.items():
        row[f"{who}_ms"] = 1e3 * statistics.median(times[who])
        row[f"{who}_peak_mb"] = peak_step_bytes(step, x, upstream) / 2**20
        errors = max_errors(step, x, upstream, reference, gamma, beta, stat_axes)
        far_errors = max_errors(
            step, far_x, far_upstream, reference, gamma, beta, stat_axes
        )
        row[f"{who}_error"], row[f"{who}_grad_error"] = errors
        row[f"{who}_far_error"], row[f"{who}_far_grad_error"] = far_errors
    row["time_ratio"] = row["ours_ms"] / row["keras_ms"]
    max_ratio, memory_capped = TARGETS[name]
    row["target_time_ratio"] = max_ratio
    row["meets_time"] = row["time_ratio"] <= max_ratio
    row["meets_memory"] = (
        row["ours_peak_mb"] <= row["keras_peak_mb"] if memory_capped else None
    )
    row["meets_error"] = all(
        row[f"ours_{kind}"] <= row[f"keras_{kind}"] * 1.0001
        for kind in ("error", "grad_error", "far_error", "far_grad_error")
    )
    return row


def print_table(rows):
    header = (
        f"{'layer (vs Keras)':<56} {'ours ms':>8} {'keras ms':>9} {'ratio':>6} "
        f"{'target':>6} {'peak MB ours/keras':>19} "
        f"{'max err ours/keras':>19} {'far err ours/keras':>19}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        label = f"{r['layer']} vs {r['keras_layer']}"
        print(
            f"{label:<56} {r['ours_ms']:8.1f} {r['keras_ms']:9.1f} "
            f"{r['time_ratio']:6.2f} {r['target_time_ratio']:6.2f} "
            f"{r['ours_peak_mb']:9.1f}/{r['keras_peak_mb']:<9.1f} "
            f"{r['ours_error']:9.2e}/{r['keras_error']:<9.2e} "
            f"{r['ours_far_error']:9.2e}/{r['keras_far_error']:<9.2e}"
        )
    print(
        "\nshapes: "
        + "; ".join(f"{r['layer']} {tuple(r['shape'])}" for r in rows)
        + "\ntime: median process CPU time of forward+backward, interleaved;"
        " error: max |output - float64 ref| (far: N(1000, 1) inputs)"
    )


# --- LayerNormalization candidates -------------------------------------------
# The implementations considered for our LayerNormalization, timed side by side
# on the same input and weights, to show why the XLA kernel was chosen.


class LayerNormCandidate:
    """A layer-like callable over float32 `gamma`/`beta` variables."""

    def __init__(self, function, gamma, beta):
        self.function = function
        self.trainable_weights = [tf.Variable(gamma), tf.Variable(beta)]

    def __call__(self, x):
        return self.function(x, *self.trainable_weights)


def fused_batch_norm_candidate(x, gamma, beta, epsilon=1e-3):
    """Keras 2's trick: FusedBatchNormV3 over rows (float32 statistics)."""
    rows, features = x.shape
    outputs, *_ = tf.raw_ops.FusedBatchNormV3(
        x=tf.reshape(x, [1, rows, features, 1]),
        scale=tf.ones([rows]),
        offset=tf.zeros([rows]),
        mean=tf.zeros([0]),
        variance=tf.zeros([0]),
        epsilon=epsilon,
        data_format="NCHW",
        is_training=True,
    )
    outputs = tf.cast(tf.reshape(outputs, [rows, features]), tf.float32)
    return tf.cast(outputs * gamma + beta, x.dtype)


def plain_float32(x, gamma, beta, epsilon=1e-3):
    """Float32 statistics with stock TF ops, TF autodiff."""
    x_wide = tf.cast(x, tf.float32)
    mean = tf.reduce_mean(x_wide, axis=-1, keepdims=True)
    centered = x_wide - mean
    variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    return tf.cast(centered * tf.math.rsqrt(variance + epsilon) * gamma + beta, x.dtype)


@tf.custom_gradient
def custom_gradient_candidate(x, gamma, beta, epsilon=1e-3):
    """Stock TF ops, a gradient that keeps only x, mean and 1/stddev."""
    x_wide = tf.cast(x, tf.float32)
    mean = tf.reduce_mean(x_wide, axis=-1, keepdims=True)
    centered = x_wide - mean
    variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    inverse_stddev = tf.math.rsqrt(variance + epsilon)
    outputs = tf.cast(centered * inverse_stddev * gamma + beta, x.dtype)

    def grad(upstream):
        upstream = tf.cast(upstream, tf.float32)
        normalized = (tf.cast(x, tf.float32) - mean) * inverse_stddev
        scaled = upstream * gamma
        x_grad = inverse_stddev * (
            scaled
            - tf.reduce_mean(scaled, axis=-1, keepdims=True)
            - normalized * tf.reduce_mean(scaled * normalized, -1, keepdims=True)
        )
        return (
            tf.cast(x_grad, x.dtype),
            tf.reduce_sum(upstream * normalized, axis=0),
            tf.reduce_sum(upstream, axis=0),
        )

    return outputs, grad


def layer_norm_candidates(quick, reps):
    """Time every candidate against Keras's layer; return one row each."""
    shape = (256, 128) if quick else (8192, 1024)
    rng = np.random.default_rng(3)
    gamma = rng.normal(1.0, 0.3, shape[-1]).astype("float32")
    beta = rng.normal(0.0, 0.3, shape[-1]).astype("float32")
    ours = layers.LayerNormalization()
    ours.build(shape)
    ours.set_weights([gamma, beta])
    theirs = keras.layers.LayerNormalization()
    theirs.build(shape)
    theirs.set_weights([gamma, beta])
    candidates = {
        "keras.layers.LayerNormalization": theirs,
        "FusedBatchNormV3 + float32 affine": fused_batch_norm_candidate,
        "float32 TF ops, autodiff": plain_float32,
        "float32 TF ops, custom gradient": custom_gradient_candidate,
        "float32, XLA autodiff": tf.function(plain_float32, jit_compile=True),
        "ours (XLA kernels, custom gradient)": ours,
    }
    steps = {
        name: make_step(
            c
            if isinstance(c, keras.layers.Layer)
            else LayerNormCandidate(c, gamma, beta)
        )
        for name, c in candidates.items()
    }
    x, upstream = random_inputs(shape, 0.0, seed=0)
    far_x, far_upstream = random_inputs(shape, 1000.0, seed=1)
    for step in steps.values():
        for _ in range(2):
            step(x, upstream)
    times = interleaved_cpu_times(steps, x, upstream, reps)
    keras_ms = 1e3 * statistics.median(times["keras.layers.LayerNormalization"])
    rows = []
    param = (gamma.astype(np.float64), beta.astype(np.float64))
    for name, step in steps.items():
        ms = 1e3 * statistics.median(times[name])
        error, _ = max_errors(step, x, upstream, normalization_reference, *param, (1,))
        far, _ = max_errors(
            step, far_x, far_upstream, normalization_reference, *param, (1,)
        )
        rows.append(
            {
                "candidate": name,
                "ms": ms,
                "ratio": ms / keras_ms,
                "error": error,
                "far_error": far,
            }
        )
    print(f"\nLayerNormalization candidates, {shape} bfloat16, forward+backward:")
    print(f"{'candidate':<38} {'ms':>7} {'ratio':>6} {'max err':>9} {'far err':>9}")
    for r in rows:
        print(
            f"{r['candidate']:<38} {r['ms']:7.1f} {r['ratio']:6.2f} "
            f"{r['error']:9.2e} {r['far_error']:9.2e}"
        )
    return rows


# --- Shapes the fixed-shape table does not show ----------------------------


def timed_pairs(pairs, reps):
    """Interleaved CPU-time medians (ms) of {label: (ours, keras, x, up)}."""
    for ours, theirs, x, upstream in pairs.values():  # warm up: compile
        for step in (ours, theirs):
            step(x, upstream)
            step(x, upstream)
    times = {label: ([], []) for label in pairs}
    for _ in range(reps):
        for label, (ours, theirs, x, upstream) in pairs.items():
            for step, bucket in zip((ours, theirs), times[label], strict=True):
                start = time.process_time()
                step(x, upstream)
                bucket.append(time.process_time() - start)
    return {
        label: tuple(1e3 * statistics.median(t) for t in pair)
        for label, pair in times.items()
    }


def row_count_scan(quick, reps):
    """LayerNormalization over (rows, 1024) for several row counts.

    XLA emits small dots as single-threaded loops: the sums switch from
    reductions to dots at 4M elements, and this shows both sides of it.
    """
    features = 128 if quick else 1024
    row_counts = (64, 256) if quick else (256, 1000, 1536, 2048, 3000, 4096, 8192)
    pairs = {}
    for rows in row_counts:
        ours, theirs = layers.LayerNormalization(), keras.layers.LayerNormalization()
        x, upstream = random_inputs((rows, features), 0.0, seed=rows)
        pairs[rows] = (make_step(ours), make_step(theirs), x, upstream)
    medians = timed_pairs(pairs, reps)
    print(f"\nLayerNormalization (rows, {features}) bfloat16, forward+backward:")
    print(f"{'rows':>6} {'ours ms':>8} {'keras ms':>9} {'ratio':>6}")
    result = []
    for rows, (ours_ms, keras_ms) in medians.items():
        print(f"{rows:6d} {ours_ms:8.1f} {keras_ms:9.1f} {ours_ms / keras_ms:6.2f}")
        result.append(
            {
                "rows": rows,
                "features": features,
                "ours_ms": ours_ms,
                "keras_ms": keras_ms,
                "ratio": ours_ms / keras_ms,
            }
        )
    return result


def make_variable_length_step(layer, features):
    """Like `make_step`, traced once for inputs of any batch size and length."""
    spec = tf.TensorSpec((None, None, features), tf.bfloat16)
    return tf.function(make_step(layer).python_function, input_signature=[spec, spec])


def variable_lengths(quick, reps):
    """Layers in a graph traced for (None, None, features) inputs.

    Each length is its own XLA shape unless the layer pads it to a bucket;
    the times are once every bucket is compiled (compilations not included).
    """
    features = 128 if quick else 1024
    lengths = (5, 9) if quick else (64, 100, 150, 200, 300, 400, 512)
    result = []
    for name, ours, theirs in (
        (
            "LayerNormalization",
            layers.LayerNormalization(),
            keras.layers.LayerNormalization(),
        ),
        ("Swish", layers.Swish(), keras.layers.Activation("swish")),
    ):
        ours_step = make_variable_length_step(ours, features)
        keras_step = make_variable_length_step(theirs, features)
        pairs = {
            length: (
                ours_step,
                keras_step,
                *random_inputs((8, length, features), 0.0, seed=length),
            )
            for length in lengths
        }
        medians = timed_pairs(pairs, reps)
        ours_ms = sum(m[0] for m in medians.values())
        keras_ms = sum(m[1] for m in medians.values())
        result.append(
            {
                "layer": name,
                "shape": f"(8, length, {features})",
                "lengths": list(lengths),
                "ours_ms": ours_ms,
                "keras_ms": keras_ms,
                "ratio": ours_ms / keras_ms,
            }
        )
    print("\nVariable length (8, L, features) bfloat16, sum over lengths of the")
    print("median forward+backward time, graph traced once for (None, None, F):")
    for r in result:
        print(
            f"{r['layer']:<20} {r['ours_ms']:8.1f} {r['keras_ms']:9.1f} "
            f"{r['ratio']:6.2f}  lengths {r['lengths']}"
        )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 reps")
    parser.add_argument("--reps", type=int, default=None, help="default 15")
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 15)
    output = args.output or RESULTS / (
        "layers_quick.json" if args.quick else "layers.json"
    )
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        rows = [run_case(case, reps) for case in cases(args.quick)]
        print_table(rows)
        candidates = layer_norm_candidates(args.quick, reps)
        scan = row_count_scan(args.quick, reps)
        variable = variable_lengths(args.quick, reps)
    finally:
        keras.config.set_dtype_policy(policy)
    output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "policy": "mixed_bfloat16",
        "reps": reps,
        "quick": args.quick,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    output.write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "layer_norm_candidates": candidates,
                "layer_norm_row_scan": scan,
                "variable_lengths": variable,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
