"""Callbacks: `AMPMonitor` watches overflows and tunes the precision lists."""

from keras_amp_plus.callbacks._amp_monitor import AMPMonitor

__all__ = ["AMPMonitor"]
