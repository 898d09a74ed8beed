"""Screenshot the real TensorBoard page of a log directory (`make screenshot`).

Starts `tensorboard --logdir LOGDIR` on 127.0.0.1 on a free port, waits until
it serves a run whose name ends in `amp` (AMPMonitor's run), renders the Time
Series dashboard filtered to the `amp/` tags with headless Chromium (Debian's
`chromium` package: `apt-get install -y chromium`), and stops TensorBoard.

    python scripts/tensorboard_screenshot.py --logdir logs/demo \
        --output docs/tensorboard_amp.png
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# No network, no profile, no background services: a reproducible render.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def find_chromium() -> str:
    """Return the Chromium executable, or exit with how to install it."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    sys.exit(
        "tensorboard_screenshot: no Chromium found (looked for "
        f"{', '.join(CHROMIUM_NAMES)}). On Debian: apt-get install -y chromium"
    )


def wait_for_amp_run(url: str, server: subprocess.Popen, timeout: float) -> list:
    """Poll TensorBoard's run list until an `amp` run is served; return the runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(
                f"tensorboard_screenshot: TensorBoard exited ({server.returncode})"
            )
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=5) as response:
                runs = json.load(response)
            if any(run.split("/")[-1] == "amp" for run in runs):
                return runs
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    sys.exit(f"tensorboard_screenshot: no `amp` run served within {timeout:.0f} s")


def screenshot(url: str, output: str, window: str, budget_ms: int) -> None:
    """Render `url` with headless Chromium into the PNG `output`."""
    with tempfile.TemporaryDirectory(prefix="kap_chromium_") as profile:
        command = [
            find_chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window}",
            # Virtual time runs the page's timers until the charts are drawn.
            f"--virtual-time-budget={budget_ms}",
            f"--screenshot={output}",
            url,
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=180)


def main(argv=None) -> int:
    """Start TensorBoard, take the screenshot, stop TensorBoard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="logs/demo")
    parser.add_argument("--output", default="docs/tensorboard_amp.png")
    parser.add_argument("--window-size", default="1400,1100")
    parser.add_argument("--virtual-time-budget", type=int, default=20000)
    parser.add_argument(
        "--page",
        default=(
            "/#scalars&tagFilter=amp%2F&_smoothingWeight=0"
            "&_ignoreYOutliers=false&regexInput=amp"
        ),
        help="path and fragment of the TensorBoard page to render",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.logdir):
        sys.exit(
            f"tensorboard_screenshot: {args.logdir} does not exist; run "
            "`python -m keras_amp_plus demo` first"
        )
    output = os.path.abspath(args.output)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as server_log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                f"--logdir={args.logdir}",
                "--host=127.0.0.1",
                f"--port={port}",
                "--reload_interval=0",
            ],
            stdout=server_log,
            stderr=subprocess.STDOUT,
        )
        try:
            runs = wait_for_amp_run(url, server, timeout=120)
            print(f"TensorBoard at {url} serves {len(runs)} runs: {', '.join(runs)}")
            screenshot(
                url + args.page, output, args.window_size, args.virtual_time_budget
            )
        finally:
            server.terminate()
            server.wait(timeout=30)
    size = os.path.getsize(output) if os.path.exists(output) else 0
    if size == 0:
        sys.exit(f"tensorboard_screenshot: Chromium wrote no image to {output}")
    print(f"wrote {output} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
