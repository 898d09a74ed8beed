"""The monitor's run read back through a real TensorBoard server's HTTP API."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import keras
import pytest
from conftest import STEPS_PER_EPOCH, overflow_model, train

from keras_amp_plus.callbacks import AMPMonitor

SERVER_START_SECONDS = 60


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(port, path, **params):
    query = urllib.parse.urlencode(params)
    url = f"http://127.0.0.1:{port}{path}" + (f"?{query}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def tensorboard_server(tmp_path):
    """Start `tensorboard --logdir tmp_path/logs`; always stop it."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(log_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load_fast=false",
        "--reload_interval",
        "1",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield str(log_dir), port, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_tags(port, process, run, tags):
    """Poll the scalars plugin until `run` has `tags` (bounded wait)."""
    deadline = time.monotonic() + SERVER_START_SECONDS
    last_error = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"tensorboard exited early: {process.stderr.read().decode()[-2000:]}"
            )
        try:
            found = get_json(port, "/data/plugin/scalars/tags").get(run, {})
            if set(tags) <= set(found):
                return found
        except OSError as error:
            last_error = error
        time.sleep(0.5)
    raise TimeoutError(f"tags {tags} of run {run!r} never appeared: {last_error}")


@pytest.mark.slow
def test_tensorboard_serves_the_amp_run(tensorboard_server):
    log_dir, port, process = tensorboard_server
    model = overflow_model("mixed_float16")
    keras_tensorboard = keras.callbacks.TensorBoard(log_dir)
    history = train(
        model, [AMPMonitor(log_dir, read_every_steps=4), keras_tensorboard], epochs=3
    )

    tags = wait_for_tags(port, process, "amp", ["amp/loss_scale", "amp/overflow/hot"])
    assert {"amp/skipped_steps", "amp/overflow_events", "amp/overflow_rate"} <= set(
        tags
    )
    deadline = time.monotonic() + 60
    while True:  # the server loads the run's points in the background
        per_layer = get_json(
            port, "/data/plugin/scalars/scalars", run="amp", tag="amp/overflow/hot"
        )
        if len(per_layer) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # Rows are [wall_time, step, value]; step is the epoch.
    assert [(row[1], row[2]) for row in per_layer] == [
        (0, STEPS_PER_EPOCH),
        (1, 0.0),
        (2, 0.0),
    ]
    scales = get_json(
        port, "/data/plugin/scalars/scalars", run="amp", tag="amp/loss_scale"
    )
    by_step = {row[1]: row[2] for row in scales}
    assert by_step[4] == 2.0**11  # read after 4 skipped steps
    # Put back to 2**15 once `hot` is denied (end of epoch 0); then current.
    assert by_step[STEPS_PER_EPOCH] == 2.0**15
    final_scale = float(model.optimizer.dynamic_scale.numpy())
    assert by_step[3 * STEPS_PER_EPOCH] == final_scale
    text_tags = get_json(port, "/data/plugin/text/tags").get("amp", [])
    assert {"amp/lists", "amp/changes"} <= set(text_tags)
    # The monitor's `logs` entries reach Keras's own TensorBoard callback.
    wait_for_tags(port, process, "train", ["epoch_loss_scale", "epoch_overflow_events"])
    keras_events = get_json(
        port, "/data/plugin/scalars/scalars", run="train", tag="epoch_overflow_events"
    )
    # Epoch 1 holds the scaler's search from the scale put back (not blamed).
    assert [row[2] for row in keras_events] == history.history["overflow_events"]
    assert keras_events[0][2] == STEPS_PER_EPOCH
