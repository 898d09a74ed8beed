"""`python -m keras_amp_plus demo`: the payoff and the rescue, on this CPU.

One small transformer classifier, on generated data, trained three ways:

1. `float32` with Keras's own layers: the baseline;
2. the recommended low-precision setup: `mixed_bfloat16`, keras_amp_plus's
   layers, `LossScaleOptimizer.guard` and `AMPMonitor`. Whether bfloat16 pays
   on this CPU is decided by the check `doctor` makes (CPU flags, oneDNN, a
   short matmul probe); when it does not, the demo says so and runs it anyway;
3. `mixed_float16`, with keras_amp_plus's dynamic loss scaler and
   `AMPMonitor`: the inputs are raw readings of order 1e5, beyond float16's
   65504, so the first layer, `embed`, overflows on every step; the monitor
   names it and moves it to float32, and training goes on.

The data is the same in all three runs (raw readings are fine in float32 and
bfloat16, which has float32's range). A table compares them at the end, and
each run leaves TensorBoard logs in `<log_dir>/<policy>/`.
"""

import json
import os
import shlex
import shutil
import statistics
import sys
import time

import keras
import numpy as np

import keras_amp_plus as kap
from keras_amp_plus import _bfloat16_outlook, _compat
from keras_amp_plus.cli import _recommendation as recommendation

SEQUENCE_LENGTH = 32
FEATURES = 32
WIDTH = 128
HEADS = 4
BLOCKS = {"default": 2, "quick": 1}  # --quick: less to trace
CLASSES = 4
BATCH_SIZE = 64
# 12 steps per epoch: the scaler halves its scale on each overflow step of the
# first float16 epoch, from 2**15 to 2**3, above its floor of 1.
TRAIN_SAMPLES = {"default": 768, "quick": 384}
TEST_SAMPLES = 256
# Five epochs: the float16 run's culprit is denied after the first and stays in
# float32 (AMPMonitor tries it again after `patience`=5 clean epochs).
DEFAULT_EPOCHS = {"default": 5, "quick": 2}
# Raw sensor-like readings: fine in float32 and bfloat16, Inf in float16.
READING_SCALE = 1e5
TEACHER_SEED = 1234
RUNS = ("float32", "mixed_bfloat16", "mixed_float16")


def make_data(samples: int, seed: int = 0) -> tuple:
    """Return `(inputs, labels)`: raw readings labelled by a fixed teacher.

    The label is the arg-max of a fixed random projection of the sequence mean,
    so there is something to learn. The readings are of order `READING_SCALE`
    (standardizing them would be the real fix; the demo shows the monitor
    keeping a float16 run alive without it).

    Args:
        samples: number of sequences.
        seed: NumPy seed. Defaults to `0`.

    Example:
    >>> inputs, labels = make_data(samples=8)
    >>> inputs.shape, labels.shape, inputs.dtype.name
    ((8, 32, 32), (8,), 'float32')
    """
    # One teacher for every seed: training and test data share their labelling.
    teacher = np.random.default_rng(TEACHER_SEED).normal(size=(FEATURES, CLASSES))
    inputs = np.random.default_rng(seed).normal(
        size=(samples, SEQUENCE_LENGTH, FEATURES)
    )
    labels = np.argmax(inputs.mean(axis=1) @ teacher, axis=-1).astype("int32")
    return (inputs * READING_SCALE).astype("float32"), labels


def build_model(policy: str, ours: bool, blocks: int = 2) -> keras.Model:
    """Return a transformer classifier under `policy`.

    Args:
        policy: Keras dtype policy name of the model's layers.
        ours: use keras_amp_plus's `LayerNormalization` and `Swish` instead of
            Keras's `LayerNormalization` and `Activation("swish")`.
        blocks: number of transformer blocks. Defaults to `2`.
    """
    norm = kap.layers.LayerNormalization if ours else keras.layers.LayerNormalization
    swish = (
        kap.layers.Swish
        if ours
        else (lambda name: keras.layers.Activation("swish", name=name))
    )
    previous = _compat.global_policy()
    _compat.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((SEQUENCE_LENGTH, FEATURES), name="readings")
        x = norm(name="embed_norm")(keras.layers.Dense(WIDTH, name="embed")(inputs))
        for block in range(blocks):
            attention = keras.layers.MultiHeadAttention(
                HEADS, WIDTH // HEADS, name=f"attention_{block}"
            )
            x = norm(name=f"attention_norm_{block}")(x + attention(x, x))
            hidden = keras.layers.Dense(4 * WIDTH, name=f"expand_{block}")(x)
            hidden = swish(name=f"swish_{block}")(hidden)
            hidden = keras.layers.Dense(WIDTH, name=f"project_{block}")(hidden)
            x = norm(name=f"mlp_norm_{block}")(x + hidden)
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        # float32 logits: the softmax cross-entropy is computed in float32.
        outputs = keras.layers.Dense(CLASSES, dtype="float32", name="logits")(x)
    finally:
        _compat.set_global_policy(previous)
    return keras.Model(inputs, outputs, name=f"demo_{policy}")


class StepTimer(keras.callbacks.Callback):
    """Record the wall-clock time of every train step (callbacks included)."""

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        """Start the clock."""
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        """Stop the clock (after the callbacks listed before this one)."""
        self.seconds.append(time.perf_counter() - self._start)

    def steps_per_second(self) -> float:
        """Return 1 / the median step time, without the first (tracing) step."""
        timed = self.seconds[1:] or self.seconds
        return 1.0 / statistics.median(timed)


def bfloat16_advice() -> dict:
    """Return doctor's dtype recommendation from the cached bfloat16 check.

    `keras_amp_plus._bfloat16_outlook.bfloat16_outlook` is the check doctor and
    `AMPMonitor` share: CPU flags and oneDNN, and a short matmul probe (run
    once per machine, then cached on disk) where the hardware leaves doubt.
    """
    outlook = _bfloat16_outlook.bfloat16_outlook()
    return recommendation.recommend(
        {"bfloat16": outlook["speedup"]},
        features=outlook["cpu"]["features"],
        onednn=outlook["onednn"],
        onednn_env=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        allocator_env=os.environ.get(recommendation.ALLOCATOR_VARIABLE),
    )


def make_optimizer(policy: str) -> keras.optimizers.Optimizer:
    """Return Adam, wrapped in keras_amp_plus's scaler for the mixed policies.

    bfloat16 has float32's exponent range: the guard mode (scale fixed at 1,
    non-finite steps skipped and recorded). float16 gets the dynamic scale.
    """
    inner = keras.optimizers.Adam(1e-3)
    if policy == "mixed_bfloat16":
        return kap.optimizers.LossScaleOptimizer.guard(inner)
    if policy == "mixed_float16":
        return kap.optimizers.LossScaleOptimizer(inner)
    return inner


def train_one(policy: str, data: dict, epochs: int, log_dir: str, blocks: int) -> dict:
    """Train the demo model under `policy` and return its row of the table."""
    print(f"\n== {policy} " + "=" * (60 - len(policy)))
    model = build_model(policy, ours=policy != "float32", blocks=blocks)
    model.compile(
        optimizer=make_optimizer(policy),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    timer = StepTimer()
    callbacks = [keras.callbacks.TensorBoard(log_dir, write_graph=False), timer]
    monitor = None
    if policy != "float32":
        monitor = kap.callbacks.AMPMonitor(log_dir)
        # First: the values the monitor adds to `logs` then reach TensorBoard.
        callbacks.insert(0, monitor)
    history = model.fit(
        data["x_train"],
        data["y_train"],
        batch_size=BATCH_SIZE,
        epochs=epochs,
        callbacks=callbacks,
        verbose=1,
    )
    loss, accuracy = model.evaluate(data["x_test"], data["y_test"], verbose=0)
    return {
        "policy": policy,
        "steps_per_second": timer.steps_per_second(),
        "test_loss": float(loss),
        "test_accuracy": float(accuracy),
        "overflow_events": (
            None if monitor is None else int(sum(history.history["overflow_events"]))
        ),
        "list_changes": list_changes(log_dir) if monitor else [],
    }


def list_changes(log_dir: str) -> list:
    """Return AMPMonitor's list changes, read from `<log_dir>/amp_events.jsonl`.

    Each is `"<name> -> <list> (epoch <n>)"`, in the order they were made.
    """
    path = os.path.join(log_dir, "amp_events.jsonl")
    with open(path, encoding="utf-8") as events:
        records = [json.loads(line) for line in events]
    return [
        f"{record['name']} -> {record['to']} (epoch {record['epoch']})"
        for record in records
        if record["type"] == "list_change"
    ]


def format_table(rows: list) -> str:
    """Render the runs as a text table; speed-ups are against the float32 row."""
    baseline = rows[0]["steps_per_second"]
    lines = [
        f"{'run':<16}{'steps/s':>9}{'vs float32':>12}{'test loss':>11}"
        f"{'test acc':>10}{'overflows':>11}  list changes",
    ]
    for row in rows:
        overflows = row["overflow_events"]
        lines.append(
            f"{row['policy']:<16}{row['steps_per_second']:>9.2f}"
            f"{row['steps_per_second'] / baseline:>11.2f}x"
            f"{row['test_loss']:>11.4f}{row['test_accuracy']:>10.3f}"
            f"{'-' if overflows is None else overflows:>11}  "
            f"{', '.join(row['list_changes']) or '-'}"
        )
    return "\n".join(lines)


# What a demo run directory holds: Keras's TensorBoard runs and AMPMonitor's files.
RUN_ENTRIES = frozenset(
    {
        "train",
        "validation",
        "amp",
        "amp_events.jsonl",
        "amp_state.json",
        # What AMPMonitor leaves when a run is killed while it writes.
        "amp_events.jsonl.tmp",
        "amp_state.json.tmp",
        ".amp_monitor_write_check",
    }
)


def foreign_entries(log_dir: str) -> list[str]:
    """Return the paths in `log_dir`'s run directories that no demo wrote.

    Example:
    >>> foreign_entries("/nonexistent")
    []
    """
    foreign = []
    for policy in RUNS:
        run_dir = os.path.join(log_dir, policy)
        if os.path.isdir(run_dir):
            names = sorted(set(os.listdir(run_dir)) - RUN_ENTRIES)
            foreign += [os.path.join(run_dir, name) for name in names]
        elif os.path.exists(run_dir):
            foreign.append(run_dir)
    return foreign


def clear_previous_runs(log_dir: str) -> None:
    """Delete this demo's own run directories under `log_dir`, nothing else.

    TensorBoard would otherwise draw a new run on top of an old one. Says
    which it deletes, so that nothing goes without a word. Call
    `foreign_entries` first: a run directory holding anything else is the
    user's, not the demo's.
    """
    for policy in RUNS:
        run_dir = os.path.join(log_dir, policy)
        if os.path.isdir(run_dir):
            print(f"Replacing the previous demo run {run_dir}")
            shutil.rmtree(run_dir)


def prepare_log_dir(log_dir: str) -> str | None:
    """Create `log_dir` and clear the demo's earlier runs; return an error or None."""
    foreign = foreign_entries(log_dir)
    if foreign:
        return (
            f"the demo writes its runs into {', '.join(RUNS)} under {log_dir}, "
            f"where it would delete what it did not write: {', '.join(foreign)}. "
            "Move those away or pass another --log-dir."
        )
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as error:
        return f"cannot create --log-dir {log_dir}: {error}"
    clear_previous_runs(log_dir)
    return None


def main(log_dir: str = "logs/demo", epochs: int | None = None, quick=False) -> int:
    """Run the three trainings, print the table and the TensorBoard command.

    Args:
        log_dir: TensorBoard log directory; each run writes `<log_dir>/<policy>`.
            Defaults to `"logs/demo"`.
        epochs: epochs per run. Defaults to `None` (5, or 2 with `quick`).
        quick: half the data, one block, 2 epochs (under a minute on two
            cores). Defaults to `False`.

    Returns:
        The process exit code: 0, or 2 when `log_dir` cannot be used.
    """
    size = "quick" if quick else "default"
    epochs = epochs or DEFAULT_EPOCHS[size]
    if epochs < 1:
        raise ValueError(f"`epochs` must be at least 1. Received: epochs={epochs}")
    log_dir = os.path.abspath(log_dir)
    error = prepare_log_dir(log_dir)
    if error:
        print(f"python -m keras_amp_plus demo: error: {error}", file=sys.stderr)
        return 2
    x_train, y_train = make_data(TRAIN_SAMPLES[size], seed=0)
    x_test, y_test = make_data(TEST_SAMPLES, seed=1)
    data = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    advice = bfloat16_advice()
    unit = "epoch" if epochs == 1 else "epochs"
    print(f"keras_amp_plus demo: {epochs} {unit} per run, logs in {log_dir}")
    print(f"low-precision check (as in `doctor`): {advice['summary']}")
    for warning in advice["warnings"]:
        print(f"  warning: {warning}")
    if advice["policy"] != "mixed_bfloat16":
        print("bfloat16 does not pay on this CPU: run 2 is shown for comparison.")
    rows = [
        train_one(policy, data, epochs, os.path.join(log_dir, policy), BLOCKS[size])
        for policy in RUNS
    ]
    print("\n" + format_table(rows))
    print(
        "\nsteps/s: 1 / median wall-clock time of a train step (first step "
        "excluded, skipped steps included); test loss and accuracy on held-out "
        "data; overflows: events AMPMonitor logged, each a skipped step."
    )
    print(f"\nNext: tensorboard --logdir {shlex.quote(log_dir)}")
    return 0
