"""Optimizers: the observable loss scaler."""

from keras_amp_plus.optimizers._loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer"]
