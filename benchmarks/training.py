"""End-to-end `fit` speed: float32, Keras mixed_bfloat16, our layers, full product.

Two small models, trained with Keras's `fit` on random data:

- "transformer": a token classifier, embedding + 2 encoder blocks
  (MultiHeadAttention with 64-feature heads, a Swish feed-forward,
  LayerNormalization after each residual), average pooling, softmax head;
  width 512, sequence 128, batch 16 (BERT-small-like);
- "cnn": three convolutions, each followed by InstanceNormalization and
  Swish, average pooling, softmax head;
- "fcn" (only with `--models`): the same CNN as a fully convolutional model,
  `keras.Input((None, None, 3))`, fed images of unknown size (a tf.data
  pipeline, `any_image_size`), so that its step is traced for any image
  size, as image-to-image and style-transfer networks are often trained.

Variants, each with `jit_compile` off and on:

- `float32`: Keras's layers (`LayerNormalization`,
  `GroupNormalization(groups=-1)`, `Activation("swish")`), float32 policy;
- `keras_bf16`: the same under `mixed_bfloat16`;
- `ours_bf16`: keras_amp_plus's layers under `mixed_bfloat16`;
- `full_product`: our layers + `LossScaleOptimizer.guard(Adam)` +
  `AMPMonitor(log_dir)` at its defaults;
- `ours_fp32` (only with `--variants`): our layers under the float32 policy,
  what runs on CPUs where bfloat16 is emulated;
- `ours_guard`, `ours_monitor` (only with `--variants`): our layers under
  `mixed_bfloat16` with only the scaler or only the monitor, which parts the
  full product's cost over `ours_bf16` comes from.

All variants of a model are built and warmed up first (one `fit` epoch:
tracing and XLA compilation are not timed), then run `--rounds` rounds, each
one `fit` epoch of `--steps` steps per variant, variants interleaved in an
order that rotates every round. A callback placed last times each epoch from
its second batch to its end (process CPU time, all threads, so other
processes on a shared machine inflate it little); steps/s are per CPU second.
The table gives the median over rounds, the spread (max - min over median) and
the speed-up over the float32 run of the same model and jit mode in this run.
A variant that cannot run (e.g. the monitor under XLA on an older build) is
reported as "n/a: <reason>" instead of stopping the run.

The JSON is written to `benchmarks/results/training_<cpu kind>.json`.

`--pipeline tfdata` feeds a `tf.data` pipeline batched without
`drop_remainder` instead of NumPy arrays: `fit` then traces the step with an
unknown batch size, as it does for most real input pipelines (its JSON gets a
`_tfdata` suffix).

Usage: python benchmarks/training.py [--quick] [--rounds N] [--steps N]
    [--models transformer cnn fcn] [--pipeline numpy|tfdata]
    [--variants float32 ours_fp32 ...] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from machine import cpu_kind, print_header

from keras_amp_plus import layers
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer

RESULTS = pathlib.Path(__file__).parent / "results"
VARIANTS = ("float32", "keras_bf16", "ours_bf16", "full_product")
ALL_VARIANTS = (*VARIANTS, "ours_fp32", "ours_guard", "ours_monitor")
OUR_LAYERS = ("ours_bf16", "full_product", "ours_fp32", "ours_guard", "ours_monitor")
GUARDED = ("full_product", "ours_guard")
MONITORED = ("full_product", "ours_monitor")
FLOAT32_VARIANTS = ("float32", "ours_fp32")
CLASSES = 10


def layer_set(ours):
    """Return constructors (layer norm, instance norm, swish) of one kind."""
    if ours:
        return layers.LayerNormalization, layers.InstanceNormalization, layers.Swish
    return (
        keras.layers.LayerNormalization,
        lambda: keras.layers.GroupNormalization(groups=-1),
        lambda: keras.layers.Activation("swish"),
    )


def transformer(ours, size):
    """A small encoder classifier over token ids."""
    layer_norm, _, swish = layer_set(ours)
    # Heads of 64 features, as in BERT and most encoders.
    length, width, vocab = size["length"], size["width"], 1000
    heads = max(1, width // 64)
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(size["blocks"]):
        attention = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layer_norm()(x + attention)
        hidden = swish()(keras.layers.Dense(4 * width)(x))
        x = layer_norm()(x + keras.layers.Dense(width)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(tokens, outputs)


def cnn(ours, size, image_size=None):
    """A small convolutional classifier with instance normalization.

    `image_size` None: the input's height and width are the size's
    `"image"`; "any": unknown (a fully convolutional model).
    """
    _, instance_norm, swish = layer_set(ours)
    side = None if image_size == "any" else size["image"]
    images = keras.Input((side, side, 3))
    x = images
    for filters, strides in ((32, 1), (64, 2), (128, 2)):
        x = keras.layers.Conv2D(filters, 3, strides=strides, padding="same")(x)
        x = swish()(instance_norm()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(images, outputs)


def data(model_name, size, steps):
    rng = np.random.default_rng(0)
    count = size["batch"] * steps
    if model_name == "transformer":
        x = rng.integers(0, 1000, (count, size["length"])).astype("int32")
    else:
        x = rng.normal(0, 1, (count, size["image"], size["image"], 3))
        x = x.astype("float32")
    return x, rng.integers(0, CLASSES, count)


def any_image_size(x, y, batch, pipeline):
    """Return `(x, y)` as a tf.data pipeline of images of unknown height and width.

    As decoded images of any size come: `fit` then traces the step for any
    image size (NumPy arrays of one size would trace that size). Batched
    with `drop_remainder` unless `pipeline` is "tfdata".
    """

    def unknown_size(image, label):
        shape = [None, None, image.shape[-1]]
        return tf.compat.v1.placeholder_with_default(image, shape), label

    images = tf.data.Dataset.from_tensor_slices((x, y)).map(unknown_size)
    return images.batch(batch, drop_remainder=pipeline != "tfdata")


class EpochTimer(keras.callbacks.Callback):
    """Process CPU time of each epoch from its second batch to its end."""

    def __init__(self):
        super().__init__()
        self.seconds, self.steps, self._start = [], [], None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            self._start = time.process_time()
        self._last_batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.process_time() - self._start)
        self.steps.append(self._last_batch)


def _reason(error):
    """Return the informative line of an exception (TF's first is generic)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "must be" in line or "not supported" in line or "compile" in line:
            return line[:200]
    return (lines[-1] if lines else "")[:200]


class Variant:
    """One model of one variant, compiled, with its own timer."""

    def __init__(self, model_name, name, jit, size, log_root):
        self.name, self.jit = name, jit
        policy = "float32" if name in FLOAT32_VARIANTS else "mixed_bfloat16"
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            self.model = BUILDERS[model_name](name in OUR_LAYERS, size)
        finally:
            keras.config.set_dtype_policy(previous)
        optimizer = keras.optimizers.Adam(1e-4)
        self.callbacks = []
        if name in GUARDED:
            optimizer = LossScaleOptimizer.guard(optimizer)
        if name in MONITORED:
            log_dir = os.path.join(log_root, f"{model_name}_{name}_{int(jit)}")
            self.callbacks.append(AMPMonitor(log_dir=log_dir))
        self.timer = EpochTimer()
        self.callbacks.append(self.timer)
        self.model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            jit_compile=jit,
        )
        self.error = None

    def run_epoch(self, data, batch):
        if self.error is not None:
            return
        x, y = data if isinstance(data, tuple) else (data, None)
        try:
            self.model.fit(
                x,
                y,
                batch_size=None if y is None else batch,
                epochs=1,
                verbose=0,
                callbacks=self.callbacks,
            )
        except Exception as error:  # report the cell, keep the run going
            self.error = f"{type(error).__name__}: {_reason(error)}"


def run_model(
    model_name, size, rounds, steps, log_root, pipeline="numpy", names=VARIANTS
):
    x, y = data(model_name, size, steps)
    batches = (x, y)
    if pipeline == "tfdata":
        # Batched without drop_remainder: `fit` traces an unknown batch size.
        batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(size["batch"])
    if model_name == "fcn":
        batches = any_image_size(x, y, size["batch"], pipeline)
    variants = [
        Variant(model_name, name, jit, size, log_root)
        for jit in (False, True)
        for name in names
    ]
    for variant in variants:  # warm-up: trace, compile
        variant.run_epoch(batches, size["batch"])
        variant.timer.seconds.clear()
        variant.timer.steps.clear()
    for round_index in range(rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.run_epoch(batches, size["batch"])
    rows = []
    for variant in variants:
        row = {"model": model_name, "variant": variant.name, "jit_compile": variant.jit}
        if variant.error is not None:
            row["error"] = variant.error
        else:
            timer = variant.timer
            rates = [s / t for s, t in zip(timer.steps, timer.seconds, strict=True)]
            median = statistics.median(rates)
            row.update(
                steps_per_cpu_second=median,
                spread=(max(rates) - min(rates)) / median,
                rounds=len(rates),
            )
        rows.append(row)
    for row in rows:
        base = next(
            r
            for r in rows
            if r["variant"] == "float32" and r["jit_compile"] == row["jit_compile"]
        )
        if "error" not in row and "error" not in base:
            row["speedup_over_float32"] = (
                row["steps_per_cpu_second"] / base["steps_per_cpu_second"]
            )
    keras.backend.clear_session()
    return rows


def print_table(rows):
    print(
        f"\n{'model':<12} {'variant':<13} {'jit':<5} {'steps/s':>8} "
        f"{'spread':>7} {'vs fp32':>8}"
    )
    for r in rows:
        head = f"{r['model']:<12} {r['variant']:<13} {r['jit_compile']!s:<5}"
        if "error" in r:
            print(f"{head} n/a: {r['error']}")
            continue
        print(
            f"{head} {r['steps_per_cpu_second']:8.2f} {100 * r['spread']:6.1f}% "
            f"{r.get('speedup_over_float32', float('nan')):7.2f}x"
        )
    print("steps/s per CPU second, median over rounds; spread = (max-min)/median")


SIZES = {
    # BERT-small-like: where real encoders spend their time (matrix products),
    # not a toy dominated by per-op overhead.
    "transformer": {"blocks": 2, "length": 128, "width": 512, "batch": 16},
    "cnn": {"image": 64, "batch": 16},
    "fcn": {"image": 64, "batch": 16},
}
QUICK_SIZES = {
    "transformer": {"blocks": 1, "length": 32, "width": 64, "batch": 8},
    "cnn": {"image": 16, "batch": 4},
    "fcn": {"image": 16, "batch": 4},
}
DEFAULT_MODELS = ("transformer", "cnn")
BUILDERS = {
    "transformer": transformer,
    "cnn": cnn,
    "fcn": lambda ours, size: cnn(ours, size, image_size="any"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 4")
    parser.add_argument("--steps", type=int, default=None, help="default 6")
    parser.add_argument(
        "--models", nargs="+", default=list(DEFAULT_MODELS), choices=SIZES
    )
    parser.add_argument(
        "--pipeline",
        choices=("numpy", "tfdata"),
        default="numpy",
        help="feed NumPy arrays (a known batch size) or a tf.data pipeline "
        "batched without drop_remainder (traced with an unknown batch size)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=ALL_VARIANTS,
        default=list(VARIANTS),
        help="variants to run; must include float32, the baseline of the others",
    )
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if "float32" not in args.variants:
        parser.error("--variants must include float32 (the baseline of each row)")
    # The defaults keep a full run under 10 minutes on 2 loaded cores.
    rounds = args.rounds or (2 if args.quick else 4)
    steps = args.steps or (4 if args.quick else 6)
    sizes = QUICK_SIZES if args.quick else SIZES
    info = print_header("End-to-end training steps per CPU second")
    tag = cpu_kind(info) + ("_quick" if args.quick else "")
    tag += "_tfdata" if args.pipeline == "tfdata" else ""
    output = args.output or RESULTS / f"training_{tag}.json"
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as log_root:
        for model_name in args.models:
            rows += run_model(
                model_name,
                sizes[model_name],
                rounds,
                steps,
                log_root,
                args.pipeline,
                args.variants,
            )
            print_table([r for r in rows if r["model"] == model_name])
    print(f"wall time {time.time() - start:.0f} s")
    meta = {
        "cpu": info,
        "cpu_kind": cpu_kind(info),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "sizes": {name: sizes[name] for name in args.models},
        "rounds": rounds,
        "steps_per_epoch": steps,
        "pipeline": args.pipeline,
        "variants": args.variants,
        "command": " ".join(["python", *sys.argv]),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
