"""The child-process helper of conftest: which crashes it runs again."""

import subprocess
import warnings

import pytest
from conftest import _crashed_outside_python, run_python


def test_a_crash_in_python_code_fails_at_once():
    # A retry would warn first: here that warning is an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(pytest.fail.Exception, match="child exited -11"):
            run_python("import ctypes; ctypes.string_at(0)")


@pytest.mark.parametrize(
    ("returncode", "stderr", "again"),
    [
        (-11, "Fatal Python error: Segmentation fault\n\nThread 0x7f (most", True),
        (-11, "Fatal Python error: Segmentation fault\n\nCurrent thread 0x7f", False),
        (-6, "Fatal Python error: Aborted\n\nThread 0x7f (most recent", True),
        (1, "Traceback (most recent call last):", False),
        (-9, "", False),  # killed from outside (out of memory): no retry
    ],
)
def test_only_crashes_outside_python_frames_run_again(returncode, stderr, again):
    done = subprocess.CompletedProcess([], returncode, stdout="", stderr=stderr)
    assert _crashed_outside_python(done) is again
