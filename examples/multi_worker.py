"""Two-worker `MultiWorkerMirroredStrategy` training with `AMPMonitor`, on one machine.

Starts two worker processes on 127.0.0.1 (each with its own `TF_CONFIG`),
trains a tiny `mixed_float16` model with our `LossScaleOptimizer` and
`AMPMonitor`, and prints each worker's lists and a checksum of its weights.

The model's layer `hot` overflows float16 on one batch of worker 1's data
only: worker 0 never sees an Inf. Every worker still skips that step, counts
it once, and denies `hot` at the same epoch, because the overflow decision and
the layer attribution are reduced across the workers.

Run it:

    python examples/multi_worker.py            # 3 epochs
    python examples/multi_worker.py --quick    # 2 epochs, for tests

Only the chief (worker 0) writes TensorBoard summaries and `amp_events.jsonl`
into `--log-dir`; both workers read the monitor's state file from there when a
job is resumed, so pass the same directory to every worker (a shared file
system on a real cluster).
"""

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

BATCH = 8  # global batch: 4 per worker
STEPS_PER_EPOCH = 4
VALIDATION_STEPS = 2  # validation and `evaluate`, on the training stream
# Per worker: one epoch reads each worker's data exactly once, so a job
# restarted at an epoch boundary reads the same batches as one never stopped.
SAMPLES = BATCH * STEPS_PER_EPOCH // 2
OVERFLOW_WORKER, OVERFLOW_BATCH = 1, 1


def free_ports(count):
    """Return `count` TCP ports free on 127.0.0.1 right now."""
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def tf_config(ports, index):
    """Return the `TF_CONFIG` of worker `index` of a local cluster."""
    workers = [f"127.0.0.1:{port}" for port in ports]
    return json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    )


def launch(worker_argv, workers=2, timeout=120.0, env=None):
    """Start `workers` processes of `worker_argv`, each with its TF_CONFIG.

    Returns one `(returncode, stdout, stderr)` per worker. Every process is
    stopped when this returns: after `timeout` seconds, or as soon as one
    worker fails, the others are killed (return code None).
    """
    ports = free_ports(workers)
    processes = []
    logs = []
    try:
        for index in range(workers):
            worker_env = dict(os.environ if env is None else env)
            worker_env["TF_CONFIG"] = tf_config(ports, index)
            worker_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            # Files, not pipes: a full pipe would block a worker. Closed below.
            out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
            err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
            logs.append((out, err))
            processes.append(
                subprocess.Popen(
                    [*worker_argv, "--worker", str(index)],
                    stdout=out,
                    stderr=err,
                    env=worker_env,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        # Like a cluster manager: when one worker fails, stop the job (its
        # peers would only wait for it in the next collective).
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            if all(code is not None for code in codes) or any(codes):
                break
            time.sleep(0.2)
    finally:
        codes = []
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
                codes.append(None)
            else:
                codes.append(process.returncode)
    results = []
    for code, (out, err) in zip(codes, logs, strict=True):
        out.seek(0)
        err.seek(0)
        results.append((code, out.read(), err.read()))
        out.close()
        err.close()
    return results


def worker_data(worker):
    """Return this worker's `(x, y)`: worker 1's batch 1 overflows `hot`."""
    import numpy as np

    rng = np.random.default_rng(worker)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = np.tanh(x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
    if worker == OVERFLOW_WORKER:
        start = OVERFLOW_BATCH * BATCH
        x[start : start + BATCH] *= 1e4
    return x, y


def worker_dataset(tf, data):
    """Return this worker's own data as a dataset of global batches.

    Sharding is off: each worker reads its own data (Keras splits every global
    batch into this worker's share).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH).repeat()
    return dataset.with_options(options)


def build_model(jit_compile=False):
    """Return the compiled model: `hot` overflows float16 on large inputs."""
    import keras

    from keras_amp_plus.optimizers import LossScaleOptimizer

    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inputs)
    h = keras.layers.Dense(
        16,
        name="hot",
        trainable=False,
        kernel_initializer=keras.initializers.RandomNormal(stddev=10.0, seed=1),
    )(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer, loss="mse", jit_compile=jit_compile)
    return model


def weights_checksum(model):
    """Return a SHA-256 prefix of every weight's bytes, in model order."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(weight.numpy().tobytes())
    return digest.hexdigest()[:16]


def run_worker(args):
    """Train on this worker (TF_CONFIG set by `launch`); print a JSON summary."""
    import tensorflow as tf

    # A lost peer fails the collectives after this long instead of hanging.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=30)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import keras

    from keras_amp_plus.callbacks import AMPMonitor, prepare_multi_worker_fit

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(args.jit_compile)
    # Keras 3's own `fit` fails under a multi-worker strategy without it.
    prepare_multi_worker_fit(model)

    dataset = worker_dataset(tf, worker_data(args.worker))
    log_dir = args.log_dir.format(worker=args.worker)
    monitor = AMPMonitor(
        log_dir,
        read_every_steps=args.read_every_steps,
        deny_threshold=args.deny_threshold,
    )
    deny_per_epoch = []
    callbacks = [
        monitor,
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: deny_per_epoch.append(
                list(monitor.lists.deny_layers)
            )
        ),
    ]
    if args.backup_dir:
        # One backup directory per worker: Keras 3's BackupAndRestore has
        # no chief logic, two workers writing one file would race.
        backup_dir = args.backup_dir.format(worker=args.worker)
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir))
    if args.kill_at and args.worker == 1:
        callbacks.append(killer(*(int(v) for v in args.kill_at.split(":"))))
    history = model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=STEPS_PER_EPOCH,
        validation_data=dataset,
        validation_steps=VALIDATION_STEPS,
        verbose=0,
        callbacks=callbacks,
    )
    evaluated = model.evaluate(dataset, steps=VALIDATION_STEPS, verbose=0)
    summary = {
        "worker": args.worker,
        "val_loss": history.history["val_loss"],
        "evaluate_loss": evaluated,
        "overflow_events": history.history["overflow_events"],
        "deny_per_epoch": deny_per_epoch,
        "lists": monitor.lists.get_config(),
        "skipped_steps": monitor.state.skipped_steps,
        "total_steps": monitor.state.total_steps,
        "checksum": weights_checksum(model),
    }
    print("SUMMARY " + json.dumps(summary, sort_keys=True), flush=True)


def killer(epoch, batch):
    """Return a callback that kills this process after `batch` of `epoch`."""
    import keras

    class Killer(keras.callbacks.Callback):
        def on_epoch_begin(self, current, logs=None):
            self.epoch = current

        def on_train_batch_end(self, current, logs=None):
            if (self.epoch, current) == (epoch, batch):
                print(f"KILLED at epoch {epoch} batch {batch}", flush=True)
                os._exit(17)  # no cleanup, like a lost machine

    return Killer()


def summaries(results):
    """Return each worker's JSON summary; raise with its stderr if one failed."""
    # A worker that failed first, then one stopped by the launcher.
    order = sorted(range(len(results)), key=lambda i: results[i][0] is None)
    for index in order:
        code, _, err = results[index]
        if code != 0:
            state = (
                "was stopped (timeout, or a peer failed)"
                if code is None
                else f"exited with {code}"
            )
            raise RuntimeError(f"worker {index} {state}:\n{err[-4000:]}")
    parsed = []
    for index, (_, out, _) in enumerate(results):
        lines = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
        if not lines:
            raise RuntimeError(f"worker {index} printed no summary:\n{out[-4000:]}")
        parsed.append(json.loads(lines[-1][len("SUMMARY ") :]))
    return parsed


def main(argv=None):
    """Launch the workers (or, with `--worker`, be one); return their summaries."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--log-dir",
        default=None,
        help="the monitor's log_dir on every worker ('{worker}' is replaced by "
        "the worker's index); default: a new temporary directory",
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--read-every-steps", type=int, default=2)
    parser.add_argument(
        "--jit-compile", action="store_true", help="refused on CPUs, see README"
    )
    parser.add_argument("--deny-threshold", type=int, default=1)
    parser.add_argument(
        "--backup-dir", default=None, help="BackupAndRestore dir ('{worker}')"
    )
    parser.add_argument(
        "--kill-at", default=None, help="EPOCH:BATCH at which worker 1 dies"
    )
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 2
    if args.worker is not None:
        run_worker(args)
        return None
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kap_multi_worker_")
    argv = [sys.executable, os.path.abspath(__file__), "--epochs", str(args.epochs)]
    argv += ["--log-dir", log_dir] + (["--jit-compile"] if args.jit_compile else [])
    results = summaries(launch(argv, timeout=args.timeout))
    for summary in results:
        print(
            f"worker {summary['worker']}: overflow events per epoch "
            f"{summary['overflow_events']}, deny layers "
            f"{summary['lists'].get('deny_layers', [])}, weights checksum "
            f"{summary['checksum']}"
        )
    same = len({json.dumps(s["lists"], sort_keys=True) for s in results}) == 1
    same &= len({s["checksum"] for s in results}) == 1
    print(f"identical lists and weights on every worker: {same}")
    print(f"chief's log: {log_dir.format(worker=0)}")
    return results


if __name__ == "__main__":
    main()
