"""Callbacks: `AMPMonitor` watches overflows and tunes the precision lists."""

from keras_amp_plus.callbacks._amp_monitor import AMPMonitor
from keras_amp_plus.callbacks._distribution import prepare_multi_worker_fit

__all__ = ["AMPMonitor", "prepare_multi_worker_fit"]
