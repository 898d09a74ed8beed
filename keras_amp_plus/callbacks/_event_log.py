"""Where the monitor writes: TensorBoard run `<log_dir>/amp`, a JSON-lines file.

`amp_events.jsonl` holds one JSON object per line: an overflow event
(`"type": "overflow"`), a list change (`"type": "list_change"`), a loss scale
put back after a denial (`"type": "scale_restored"`) or a denied layer that
still overflows (`"type": "denial_without_effect"`), each with the number of
the run (`"run"`) that wrote it; runs in one directory are appended. Every line
is flushed when written, so a crash loses nothing already reported, and the
file can be cut back to a known line count when an interrupted `fit` resumes.
"""

import json
import logging
import os

import tensorflow as tf

logger = logging.getLogger("keras_amp_plus")

EVENTS_FILE = "amp_events.jsonl"
TENSORBOARD_RUN = "amp"


def check_writable(log_dir: str) -> None:
    """Raise a clear error unless files can be created in `log_dir`."""
    probe = os.path.join(log_dir, ".amp_monitor_write_check")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            "AMPMonitor cannot write to its `log_dir` (TensorBoard run "
            f"'{TENSORBOARD_RUN}', {EVENTS_FILE} and the monitor state go there): "
            f"{error}. Pass a writable directory or `log_dir=None` to log to "
            f"Python logging only. Received: log_dir={log_dir!r}"
        ) from error


class EventLog:
    """Writes overflow events and list changes to TensorBoard and JSON lines.

    Args:
        log_dir: directory of the logs, or None to write nowhere but Python
            logging. Defaults to `None`.
    """

    def __init__(self, log_dir: str | None = None):
        self.log_dir = log_dir
        self.events_path = os.path.join(log_dir, EVENTS_FILE) if log_dir else None
        self.lines_written = 0
        self._writer = None
        self._file = None

    def open(self, keep_lines: int | None) -> None:
        """Open the writers; keep the first `keep_lines` lines (None: all).

        A new run appends after every earlier run's lines; a resumed run cuts
        the file back to the length it had at the end of the last saved epoch.
        """
        if not self.log_dir:
            return
        check_writable(self.log_dir)
        lines = []
        if os.path.exists(self.events_path):
            with open(self.events_path) as f:
                lines = f.readlines()
        if keep_lines is not None and keep_lines < len(lines):
            lines = lines[:keep_lines]
            with open(self.events_path, "w") as f:
                f.writelines(lines)
        self.lines_written = len(lines)
        self._file = open(self.events_path, "a")  # noqa: SIM115 - kept open
        self._writer = tf.summary.create_file_writer(
            os.path.join(self.log_dir, TENSORBOARD_RUN)
        )

    def close(self) -> None:
        """Flush and close the writers."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def write_record(self, record: dict) -> None:
        """Append one JSON object to `amp_events.jsonl`."""
        if self._file is None:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        self.lines_written += 1

    def scalars(self, values: dict, step: int) -> None:
        """Write `{tag: value}` scalars at `step` (None values are skipped)."""
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            for tag, value in values.items():
                if value is not None:
                    tf.summary.scalar(tag, float(value))

    def text(self, tag: str, markdown: str, step: int) -> None:
        """Write a markdown text summary."""
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            tf.summary.text(tag, markdown)

    def flush(self) -> None:
        """Make everything written so far visible to TensorBoard."""
        if self._writer is not None:
            self._writer.flush()


def changes_markdown(changes: list[dict]) -> str:
    """Render list changes as a markdown table for TensorBoard's text tab."""
    rows = [
        "| kind | name | from | to | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for change in changes:
        rows.append(
            f"| {change['kind']} | {change['name']} | {change['from']} | "
            f"{change['to']} | {change['reason']} |"
        )
    return "\n".join(rows)
