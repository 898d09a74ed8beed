"""Where the monitor writes: TensorBoard run `<log_dir>/amp`, a JSON-lines file.

`amp_events.jsonl` holds one JSON object per line: an overflow event
(`"type": "overflow"`), a list change (`"type": "list_change"`), a loss scale
put back after a denial (`"type": "scale_restored"`) or a denied layer that
still overflows (`"type": "denial_without_effect"`), each with the number of
the run (`"run"`) that wrote it; runs in one directory are appended. Lines are
flushed as they are written (each read's events at once: on `gs://` every flush
uploads the whole file), so a crash loses nothing already reported, and the
file can be cut back to a known line count when an interrupted `fit` resumes.
Files go through TensorFlow's file systems (`tf.io.gfile`), as TensorBoard's
event files do, so a `log_dir` such as `gs://bucket/logs` holds all of them.
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
        tf.io.gfile.makedirs(log_dir)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("ok")
        tf.io.gfile.remove(probe)
    except (OSError, tf.errors.OpError) as error:
        raise ValueError(
            "AMPMonitor cannot write to its `log_dir` (TensorBoard run "
            f"'{TENSORBOARD_RUN}', {EVENTS_FILE} and the monitor state go there): "
            f"{error}. Pass a writable directory or `log_dir=None` to log to "
            f"Python logging only. Received: log_dir={log_dir!r}"
        ) from error
    for name, directory in ((TENSORBOARD_RUN, True), (EVENTS_FILE, False)):
        path = os.path.join(log_dir, name)
        if tf.io.gfile.exists(path) and tf.io.gfile.isdir(path) != directory:
            raise ValueError(
                f"AMPMonitor writes its {'TensorBoard run' if directory else 'events'}"
                f" to {path}, which exists as a "
                f"{'file' if directory else 'directory'}. Move it away or pass "
                f"another `log_dir`. Received: log_dir={log_dir!r}"
            )


def highest_run(log_dir: str | None) -> int:
    """Return the highest run number in `log_dir`'s events file (0 when none).

    A run killed before its first epoch ended saved no state, but its lines
    are in the file: the next run must be numbered after them.

    Example:
    >>> highest_run(None)
    0
    """
    path = os.path.join(log_dir, EVENTS_FILE) if log_dir else None
    if path is None or not tf.io.gfile.exists(path):
        return 0
    highest = 0
    with tf.io.gfile.GFile(path) as f:
        for line in f:
            try:
                run = json.loads(line).get("run", 0)
            except (ValueError, AttributeError):
                continue  # a line cut short by a crash
            if isinstance(run, int):
                highest = max(highest, run)
    return highest


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
        if tf.io.gfile.exists(self.events_path):
            with tf.io.gfile.GFile(self.events_path) as f:
                lines = f.readlines()
        kept = lines if keep_lines is None else lines[:keep_lines]
        if kept and not kept[-1].endswith("\n"):
            kept = kept[:-1]  # cut short by a crash: the next line would join it
        if len(kept) < len(lines):
            self._rewrite(kept)
        self.lines_written = len(kept)
        self._file = tf.io.gfile.GFile(self.events_path, "a")
        self._file.write("")  # creates the file: a run without events has one
        self._writer = tf.summary.create_file_writer(
            os.path.join(self.log_dir, TENSORBOARD_RUN)
        )

    def _rewrite(self, lines: list[str]) -> None:
        """Replace the events file by `lines`, atomically where renames are.

        Through a temporary file, as the state file: a crash while writing
        leaves the old file whole.
        """
        temporary = self.events_path + ".tmp"
        with tf.io.gfile.GFile(temporary, "w") as f:
            f.write("".join(lines))
        tf.io.gfile.rename(temporary, self.events_path, overwrite=True)

    def close(self) -> None:
        """Flush and close the writers."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def write_records(self, records: list[dict]) -> None:
        """Append JSON objects to `amp_events.jsonl`, one line each; flush once."""
        if self._file is None or not records:
            return
        self._file.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        self._file.flush()
        self.lines_written += len(records)

    def write_record(self, record: dict) -> None:
        """Append one JSON object to `amp_events.jsonl` (see `write_records`)."""
        self.write_records([record])

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
