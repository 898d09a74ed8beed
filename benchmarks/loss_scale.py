"""Benchmark keras_amp_plus's LossScaleOptimizer against Keras's scaler.

One compiled `fit` train step (`model.train_function`, the function `fit`
calls each batch) of the same MLP (Dense+ReLU+LayerNorm blocks) on the same
data, under `mixed_float16` and `mixed_bfloat16` (the model is sized per policy
for a 10-50 ms step). For each policy every variant gets a model with the same
initial weights; variants are timed interleaved (the order rotates every
repetition), each timing is the process CPU time (`time.process_time()`, all
threads) of `--steps` train steps divided by the step count, and the table
shows the median of `--reps` repetitions and the overhead against Keras's
scaler: the median over repetitions of (ours / keras) in that repetition. Variants:

- keras: `keras.optimizers.LossScaleOptimizer(Adam)`;
- ours: `keras_amp_plus.optimizers.LossScaleOptimizer(Adam)` (defaults);
- ours_guard: `LossScaleOptimizer.guard(Adam)` (bfloat16 only: scale fixed at 1).

A second measure, apply_only, times `optimizer.apply` alone on the same
variables (the scaler's own cost without the model). Target: the train step
with ours at most 2% slower than with keras.

Usage: python benchmarks/loss_scale.py [--quick] [--reps N] [--steps N] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from machine import print_header

from keras_amp_plus.optimizers import LossScaleOptimizer

RESULTS = pathlib.Path(__file__).parent / "results"
TARGET_OVERHEAD = 0.02
VARIANTS = {
    "mixed_float16": ("keras", "ours"),
    "mixed_bfloat16": ("keras", "ours", "ours_guard"),
}
# Per policy, sized for a 10-50 ms step: float16 matmuls have no fast CPU
# kernels here (about 100x slower than bfloat16 on AMX), so its model is smaller.
MODEL_SIZES = {  # batch, features, width, depth
    "mixed_float16": (64, 64, 64, 4),
    "mixed_bfloat16": (256, 512, 512, 6),
}
QUICK_MODEL_SIZES = {
    "mixed_float16": (32, 64, 64, 4),
    "mixed_bfloat16": (256, 256, 256, 4),
}


def build_model(width, depth, num_features):
    """An MLP with LayerNorm between blocks: many variables, like real models."""
    inputs = keras.Input((num_features,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="relu")(x)
        x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(10, dtype="float32")(x)
    return keras.Model(inputs, outputs)


def make_optimizer(variant):
    inner = keras.optimizers.Adam(1e-4)
    if variant == "keras":
        return keras.optimizers.LossScaleOptimizer(inner)
    if variant == "ours":
        return LossScaleOptimizer(inner)
    return LossScaleOptimizer.guard(inner)


def make_runs(policy, args):
    """Return {variant: (model, iterator)} with identical weights and data."""
    keras.config.set_dtype_policy(policy)
    batch, features, width, depth = args.sizes[policy]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, features)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    reference_weights = None
    runs = {}
    for variant in VARIANTS[policy]:
        keras.utils.set_random_seed(0)
        model = build_model(width, depth, features)
        if reference_weights is None:
            reference_weights = model.get_weights()
        model.set_weights(reference_weights)
        model.compile(make_optimizer(variant), "sparse_categorical_crossentropy")
        model.make_train_function()
        iterator = iter(dataset)
        time_steps(model, iterator, 10)  # trace and warm up
        runs[variant] = (model, iterator)
    return runs


def time_steps(model, iterator, steps):
    start = time.process_time()
    for _ in range(steps):
        outputs = model.train_function(iterator)
    # Wait for the last step: TF runs ops asynchronously.
    tf.nest.map_structure(lambda t: np.asarray(t), outputs)
    return (time.process_time() - start) / steps


def interleaved_times(timers, reps):
    """Call each timer once per repetition, rotating the order; return times."""
    names = list(timers)
    for name in names:  # one untimed round: caches and thread pools settle
        timers[name]()
    times = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timers[name]())
    return times


def apply_only_timer(model, steps):
    """Time `optimizer.apply` alone (the scaler's own cost, no model)."""
    variables = model.trainable_variables
    grads = [tf.fill(v.shape, 1e-3) for v in variables]
    apply = tf.function(lambda: model.optimizer.apply(grads, variables))

    def timer():
        start = time.process_time()
        for _ in range(steps):
            apply()
        np.asarray(model.optimizer.iterations)  # wait for the last apply
        return (time.process_time() - start) / steps

    timer()  # trace
    return timer


def summarize(policy, measure, times, runs):
    rows = []
    for variant, variant_times in times.items():
        optimizer = runs[variant][0].optimizer
        # Ratios within one repetition cancel the slow drift of a shared machine.
        ratios = [t / k for t, k in zip(variant_times, times["keras"], strict=True)]
        rows.append(
            {
                "policy": policy,
                "measure": measure,
                "variant": variant,
                "median_ms": statistics.median(variant_times) * 1e3,
                "overhead_vs_keras": statistics.median(ratios) - 1.0,
                "times_ms": [t * 1e3 for t in variant_times],
                "skipped_steps": int(
                    getattr(optimizer, "overflow_count", tf.constant(0)).numpy()
                ),
            }
        )
    return rows


def benchmark_policy(policy, args):
    runs = make_runs(policy, args)
    step_timers = {
        variant: (lambda m=model, i=iterator: time_steps(m, i, args.steps))
        for variant, (model, iterator) in runs.items()
    }
    rows = summarize(
        policy, "train_step", interleaved_times(step_timers, args.reps), runs
    )
    apply_timers = {
        variant: apply_only_timer(model, args.steps)
        for variant, (model, _) in runs.items()
    }
    rows += summarize(
        policy, "apply_only", interleaved_times(apply_timers, args.reps), runs
    )
    return rows


def print_table(rows):
    header = (
        f"{'policy':<16}{'measure':<12}{'variant':<12}{'median ms':>11}{'vs keras':>10}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['policy']:<16}{row['measure']:<12}{row['variant']:<12}"
            f"{row['median_ms']:>11.2f}"
            f"{row['overhead_vs_keras']:>+10.1%}"
        )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--policy", choices=list(VARIANTS), default=None)
    args = parser.parse_args()
    args.sizes = QUICK_MODEL_SIZES if args.quick else MODEL_SIZES
    if args.quick:
        args.reps = args.reps or 5
        args.steps = args.steps or 5
    args.reps = args.reps or 15
    args.steps = args.steps or 20
    name = "loss_scale_quick.json" if args.quick else "loss_scale.json"
    args.output = args.output or str(RESULTS / name)
    return args


def main():
    args = parse_args()
    machine = print_header("LossScaleOptimizer train-step overhead, ours vs Keras's")
    policy_before = keras.config.dtype_policy()
    try:
        rows = []
        for policy in [args.policy] if args.policy else VARIANTS:
            rows.extend(benchmark_policy(policy, args))
    finally:
        keras.config.set_dtype_policy(policy_before)
    print_table(rows)
    ours = [r for r in rows if r["variant"] == "ours" and r["measure"] == "train_step"]
    worst = max(r["overhead_vs_keras"] for r in ours)
    print(f"worst overhead of ours vs keras: {worst:+.1%} (target <= +2.0%)")
    result = {
        "benchmark": "loss_scale",
        "config": {
            "quick": args.quick,
            "reps": args.reps,
            "steps": args.steps,
            "model_sizes_batch_features_width_depth": args.sizes,
        },
        "machine": machine,
        "timer": "time.process_time (process CPU time, all threads) per train step",
        "target_overhead": TARGET_OVERHEAD,
        "worst_overhead_ours": worst,
        "meets_target": worst <= TARGET_OVERHEAD,
        "rows": rows,
    }
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
