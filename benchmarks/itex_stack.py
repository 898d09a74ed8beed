"""Benchmark mixed precision on the ITEX stack (TF 2.15 + Keras 2.15 + ITEX).

One compiled `fit` train step (`model.train_function`) of a small transformer
encoder (attention + Swish MLP blocks with pre-residual LayerNormalization),
in six variants, each a model with the same initial weights on the same data:

- precision: `float32`; Keras's `mixed_bfloat16` policy; ITEX Advanced AMP
  (a float32 model, `AMPMonitor(engine="itex")`'s engine: the graph rewritten
  to bfloat16 by op type);
- layers: Keras's (`keras.layers.LayerNormalization`, `Activation("swish")`)
  or ours (`keras_amp_plus.layers.LayerNormalization`, `Swish`).

ITEX's config is process-global but read only when a function is optimized:
the float32 and policy variants are built and run first with Advanced AMP off,
then Advanced AMP is switched on and only the ITEX variants are rebuilt. The
timed phase creates no new rewrite (checked from ITEX's rewrite log). Variants
are timed interleaved (the order rotates every repetition); each timing is the
process CPU time of `--steps` steps divided by the step count, the table shows
the median of `--reps` repetitions and the ratio to float32 with Keras's layers.

Usage: python benchmarks/itex_stack.py [--quick] [--reps N] [--steps N] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_amp_plus as kap
from keras_amp_plus import _compat
from keras_amp_plus import _itex_probe as itex_probe
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines import ItexEngine
from keras_amp_plus.engines import _itex_log as itex_log

RESULTS = pathlib.Path(__file__).parent / "results"
PRECISIONS = ("float32", "mixed_bfloat16", "itex_amp")
LAYER_SETS = ("keras", "ours")
SIZES = {  # batch, sequence, width, heads, blocks
    "full": (32, 128, 256, 4, 2),
    "quick": (16, 64, 128, 4, 1),
}
MATMUL_TYPES = ("MatMul", "_ITEXFusedMatMul", "_ITEXFusedMatMulGrad", "Einsum")


def normalization(layers):
    if layers == "ours":
        return kap.layers.LayerNormalization(epsilon=1e-5)
    return keras.layers.LayerNormalization(epsilon=1e-5)


def swish(layers):
    return kap.layers.Swish() if layers == "ours" else keras.layers.Activation("swish")


def transformer(layers, policy, size):
    """Return a compiled transformer encoder built under `policy`."""
    _, sequence, width, heads, blocks = size
    _compat.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((sequence, width))
        # The embedding puts the residual stream in the compute dtype (Keras 2
        # does not promote float32 + bfloat16).
        x = keras.layers.Dense(width)(inputs)
        for _ in range(blocks):
            attention = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
            x = normalization(layers)(x + attention)
            h = keras.layers.Dense(4 * width)(x)
            h = keras.layers.Dense(width)(swish(layers)(h))
            x = normalization(layers)(x + h)
        pooled = keras.layers.GlobalAveragePooling1D()(x)
        outputs = keras.layers.Dense(10, dtype="float32")(pooled)
        model = keras.Model(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    finally:
        _compat.set_global_policy("float32")
    return model


def data_iterator(size):
    batch, sequence, width, _, _ = size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, sequence, width)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    return iter(tf.data.Dataset.from_tensors((x, y)).repeat())


def time_steps(model, iterator, steps):
    start = time.process_time()
    for _ in range(steps):
        outputs = model.train_function(iterator)
    tf.nest.map_structure(np.asarray, outputs)  # wait for the last step
    return (time.process_time() - start) / steps


def build_variants(size, log_dir):
    """Return `{(precision, layers): (model, iterator)}`, each warmed up."""
    variants = {}
    for precision in PRECISIONS:
        for layers in LAYER_SETS:
            policy = "mixed_bfloat16" if precision == "mixed_bfloat16" else "float32"
            variants[(precision, layers)] = (
                transformer(layers, policy, size),
                data_iterator(size),
            )
    engines = []
    for (precision, _), (model, iterator) in variants.items():
        if precision != "itex_amp":
            model.make_train_function()
            time_steps(model, iterator, 2)  # optimized with Advanced AMP off
    before = itex_log.count_rewrites(log_dir)
    for (precision, _), (model, iterator) in variants.items():
        if precision == "itex_amp":
            engine = ItexEngine()
            engine.apply(model, PrecisionLists())  # Advanced AMP on, rebuilt
            time_steps(model, iterator, 2)
            engines.append(engine)
    rewrites = itex_log.read_rewrites(log_dir, since=before)
    converted = sum(r["converted"][op] for r in rewrites for op in MATMUL_TYPES)
    return variants, engines, converted


def interleaved_times(variants, reps, steps):
    names = list(variants)
    for name in names:
        time_steps(*variants[name], steps)  # one untimed round
    times = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_steps(*variants[name], steps))
    return times


def summarize(times):
    baseline = times[("float32", "keras")]
    rows = []
    for (precision, layers), values in times.items():
        ratios = [v / b for v, b in zip(values, baseline, strict=True)]
        rows.append(
            {
                "precision": precision,
                "layers": layers,
                "median_ms": 1000 * statistics.median(values),
                "ratio_vs_float32_keras_layers": statistics.median(ratios),
                "times_ms": [1000 * v for v in values],
            }
        )
    return rows


def print_table(rows):
    header = f"{'precision':<16}{'layers':<8}{'median ms':>11}{'vs fp32/keras':>15}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['precision']:<16}{row['layers']:<8}{row['median_ms']:>11.2f}"
            f"{row['ratio_vs_float32_keras_layers']:>14.2f}x"
        )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    args.size = SIZES["quick" if args.quick else "full"]
    args.reps = args.reps or (3 if args.quick else 9)
    args.steps = args.steps or (3 if args.quick else 5)
    name = "itex_stack_quick.json" if args.quick else "itex_stack.json"
    args.output = args.output or str(RESULTS / name)
    return args


def main():
    args = parse_args()
    itex = _compat.itex_module()
    if itex is None:
        raise SystemExit("This benchmark needs the ITEX stack: run `make bench-itex`.")
    status = itex_probe.itex_bfloat16_status()
    if not status["works"]:
        raise SystemExit(
            f"ITEX's bfloat16 kernels do not work here: {status['reason']}"
        )
    with tempfile.TemporaryDirectory() as log_dir:
        os.environ[itex_log.LOG_PATH_ENV] = log_dir
        variants, engines, converted = build_variants(args.size, log_dir)
        rewrites_before = itex_log.count_rewrites(log_dir)
        times = interleaved_times(variants, args.reps, args.steps)
        new_rewrites = itex_log.count_rewrites(log_dir) - rewrites_before
        for engine in engines:
            engine.restore()
        del os.environ[itex_log.LOG_PATH_ENV]
    if converted == 0 or new_rewrites:
        raise SystemExit(
            f"Invalid run: {converted} MatMuls converted by Advanced AMP, "
            f"{new_rewrites} rewrites during the timed phase."
        )
    rows = summarize(times)
    print_table(rows)
    print(f"Advanced AMP converted {converted} MatMul/Einsum nodes to bfloat16.")
    batch, sequence, width, heads, blocks = args.size
    result = {
        "benchmark": "itex_stack",
        "config": {
            "quick": args.quick,
            "reps": args.reps,
            "steps": args.steps,
            "batch": batch,
            "sequence": sequence,
            "width": width,
            "heads": heads,
            "blocks": blocks,
        },
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cpu": platform.processor() or None,
            "itex_backend": status["backend"],
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "itex": getattr(itex, "__version__", None),
        },
        "advanced_amp_converted_matmuls": converted,
        "rows": rows,
    }
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
