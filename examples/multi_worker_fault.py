"""A worker killed mid-epoch; the job restarted with `BackupAndRestore`.

Three jobs of two workers each on 127.0.0.1 (`examples/multi_worker.py`):

1. reference: 3 epochs, never interrupted;
2. interrupted: the same, but worker 1 dies (`os._exit`) in epoch 1 right after
   an overflow step the chief has already logged; the launcher then stops the
   whole job, as a cluster manager would;
3. restarted: the same command again. `keras.callbacks.BackupAndRestore`
   restores weights and optimizer (our scaler's counters included) as of the
   end of epoch 0 and resumes at epoch 1; `AMPMonitor` resumes from its
   snapshot of epoch 0 in the chief's `amp_state.json` (every worker reads it)
   and cuts the chief's `amp_events.jsonl` back to its end-of-epoch-0 length.

`hot` overflows on worker 1's data at steps 3 and 4 of every epoch and is
denied at the end of epoch 1 (`deny_threshold=3`: evidence 2, then
2 * 0.7 + 2). The script prints both jobs' lists, counters, logged overflow
steps and weight checksums, and exits 1 unless they match.

    python examples/multi_worker_fault.py
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import multi_worker  # the example next to this file

EPOCHS = 3
KILL_AT = "1:2"  # epoch 1, after batch 2 (step 7, an overflow step)


def job_argv(root, kill=False):
    """Return the worker command line of one job writing under `root`."""
    argv = [sys.executable, os.path.abspath(multi_worker.__file__)]
    argv += ["--epochs", str(EPOCHS), "--log-dir", os.path.join(root, "logs")]
    argv += ["--backup-dir", os.path.join(root, "backup-{worker}")]
    argv += ["--deny-threshold", "3", "--read-every-steps", "1"]
    return argv + (["--kill-at", KILL_AT] if kill else [])


def overflow_lines(root):
    """Return `(epoch, step, layers)` of each overflow the chief logged."""
    path = os.path.join(root, "logs", "amp_events.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return [
        (r["epoch"], r["step"], r["layers"]) for r in records if r["type"] == "overflow"
    ]


def comparable(summary):
    """Return what must be equal on every worker of both jobs."""
    return {
        key: summary[key]
        for key in ("lists", "skipped_steps", "total_steps", "checksum")
    }


def main(timeout=150.0):
    """Run the three jobs; return True when the restarted one matches."""
    root = tempfile.mkdtemp(prefix="kap_fault_")
    reference_root = os.path.join(root, "reference")
    faulty_root = os.path.join(root, "faulty")
    reference = multi_worker.summaries(
        multi_worker.launch(job_argv(reference_root), timeout=timeout)
    )
    interrupted = multi_worker.launch(job_argv(faulty_root, kill=True), timeout=timeout)
    codes = [code for code, _, _ in interrupted]
    killed = any("KILLED" in out for _, out, _ in interrupted)
    logged_before_restart = overflow_lines(faulty_root)
    print(f"interrupted job: return codes {codes}, worker 1 killed: {killed}")
    print(f"  chief's overflow lines at the kill: {logged_before_restart}")
    restarted = multi_worker.summaries(
        multi_worker.launch(job_argv(faulty_root), timeout=timeout)
    )
    rows = [("reference", s) for s in reference] + [("restarted", s) for s in restarted]
    for name, summary in rows:
        print(
            f"{name} worker {summary['worker']}: deny {summary['lists']['deny_layers']}"
            f", skipped_steps {summary['skipped_steps']}, total_steps "
            f"{summary['total_steps']}, checksum {summary['checksum']}"
        )
    print(f"reference chief's overflow lines: {overflow_lines(reference_root)}")
    print(f"restarted chief's overflow lines: {overflow_lines(faulty_root)}")
    same = (
        killed
        and all(comparable(s) == comparable(reference[0]) for _, s in rows)
        and overflow_lines(faulty_root) == overflow_lines(reference_root)
    )
    print(f"restarted job equals the uninterrupted one: {same}")
    return same


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
