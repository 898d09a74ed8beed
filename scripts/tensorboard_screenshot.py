"""Screenshot the real TensorBoard page of a log directory (`make screenshot`).

Starts `tensorboard --logdir LOGDIR` on 127.0.0.1 on a free port, waits until
it serves a run whose name ends in `amp` (AMPMonitor's run), renders the
Scalars dashboard filtered to the `amp` runs and `amp/` tags with headless
Chromium (Debian's `chromium` package: `apt-get install -y chromium`), driven
over its DevTools pipe, and stops TensorBoard.

    python scripts/tensorboard_screenshot.py --logdir logs/demo \
        --output docs/tensorboard_amp.png
"""

import argparse
import base64
import json
import os
import select
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


class DevTools:
    """A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe`.

    Chromium reads JSON commands from its fd 3 and writes replies and events
    to its fd 4, each message ending with a NUL byte. Only what the screenshot
    needs: send a command and wait for its reply.
    """

    def __init__(self, command: list):
        to_chromium, self._write = os.pipe()
        self._read, from_chromium = os.pipe()

        def give_chromium_its_pipes():
            os.dup2(to_chromium, 3)
            os.dup2(from_chromium, 4)

        self.process = subprocess.Popen(  # preexec_fn only dup2s: no locks involved
            [*command, "--remote-debugging-pipe"],
            preexec_fn=give_chromium_its_pipes,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chromium)
        os.close(from_chromium)
        self._buffer = b""
        self._next_id = 0
        self.session = None

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        """Send one command (to the attached page, if any); return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(f"Chromium did not answer {method} in {timeout} s")

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._read], [], [], 1.0)
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium stopped answering")
            if ready:
                chunk = os.read(self._read, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        """Close the browser and the pipes."""
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            self.process.kill()
        self.process.wait(timeout=30)
        os.close(self._write)
        os.close(self._read)


def screenshot(url: str, output: str, window: str, settle_seconds: float) -> None:
    """Render `url` with headless Chromium into the PNG `output`.

    TensorBoard keeps "Ignore outliers in chart scaling" in the page's
    localStorage (default on: a single overflow epoch would be cut off the
    chart), so it is switched off there and the page reloaded before the
    screenshot.
    """
    width, height = (int(size) for size in window.split(","))
    with tempfile.TemporaryDirectory(prefix="kap_chromium_") as profile:
        browser = DevTools(
            [
                find_chromium(),
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ]
        )
        try:
            target = browser.send("Target.createTarget", url="about:blank")
            attached = browser.send(
                "Target.attachToTarget", targetId=target["targetId"], flatten=True
            )
            browser.session = attached["sessionId"]
            browser.send(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            browser.send("Page.navigate", url=url)
            time.sleep(settle_seconds / 2)
            browser.send(
                "Runtime.evaluate",
                expression="localStorage.setItem('_ignoreYOutliers', 'false'); "
                "location.reload(); true",
            )
            # TensorBoard loads its scalars asynchronously after the reload.
            time.sleep(settle_seconds)
            image = browser.send("Page.captureScreenshot", format="png")["data"]
        finally:
            browser.close()
    with open(output, "wb") as png:
        png.write(base64.b64decode(image))


def main(argv=None) -> int:
    """Start TensorBoard, take the screenshot, stop TensorBoard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="logs/demo")
    parser.add_argument("--output", default="docs/tensorboard_amp.png")
    parser.add_argument("--window-size", default="1400,1100")
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=10.0,
        help="time for TensorBoard to load and draw the charts (default: 10)",
    )
    parser.add_argument(
        "--page",
        default=("/#scalars&tagFilter=amp%2F&_smoothingWeight=0&regexInput=amp"),
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
            screenshot(url + args.page, output, args.window_size, args.settle_seconds)
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
