"""Argument and input checks shared by the layers, with Keras-style messages."""

import math
import numbers

import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import _precision


def check_epsilon(epsilon) -> float:
    """Return `epsilon` as a float, or raise unless it is a positive number."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(
            "`epsilon` must be a positive float added to the variance. "
            f"Received: epsilon={epsilon!r} of type {type(epsilon).__name__}"
        )
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(
            "`epsilon` must be positive and finite: it keeps the division by the "
            "standard deviation finite for constant inputs (an infinite one "
            "zeroes every output). Use a small value such as 1e-3 or 1e-5. "
            f"Received: epsilon={epsilon}"
        )
    return float(epsilon)


def check_bool(value, name: str) -> bool:
    """Return `value` as a bool, or raise TypeError unless it is one."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"`{name}` must be True or False; other values are not read as "
            f"truth values (the string 'no' would count as True). Received: "
            f"{name}={value!r} of type {type(value).__name__}"
        )
    return bool(value)


def _is_float_tensor(value) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return False
    return "float" in _compat.standardize_dtype(dtype)


def check_swish_beta(beta, allow_tensors: bool):
    """Return `beta` (a float, or a float tensor if allowed), or raise.

    Raises TypeError for anything that is not a real number (or, when
    `allow_tensors`, a float tensor or variable), ValueError for nan/inf.
    """
    if isinstance(beta, np.ndarray) and beta.ndim == 0:
        beta = beta.item()  # a 0-d array holds a number
    is_number = isinstance(beta, numbers.Real) and not isinstance(beta, bool)
    if not is_number and not (allow_tensors and _is_float_tensor(beta)):
        expected = "a float or a float tensor" if allow_tensors else "a float"
        raise TypeError(
            f"`beta` must be {expected}, the scale of the sigmoid's input. "
            f"Pass a number such as 1.0. Received: beta={beta!r} of type "
            f"{type(beta).__name__}"
        )
    if not is_number and _rank(beta.shape) not in (0, None):
        # Its gradient is summed to one number: a beta per channel would get
        # every channel's sum.
        raise ValueError(
            "`beta` must be a scalar: one scale of the sigmoid's input. For a "
            "learned one, use `keras_amp_plus.layers.Swish(trainable_beta=True)`. "
            f"Received: beta.shape={tuple(beta.shape)}"
        )
    if is_number and not math.isfinite(beta):
        raise ValueError(
            "`beta` must be finite: the sigmoid of an infinite or nan scale "
            "gives a step function or nan outputs. Pass a number such as 1.0. "
            f"Received: beta={beta}"
        )
    return float(beta) if is_number else beta


def _rank(shape) -> int | None:
    """Return the rank of a `TensorShape` (None if unknown) or a NumPy shape."""
    rank = getattr(shape, "rank", None)
    return len(shape) if rank is None and isinstance(shape, tuple) else rank


def check_axis_type(axis, allow_list: bool):
    """Raise TypeError unless `axis` is an int (or, if allowed, ints)."""
    expected = "an int or a list/tuple of ints" if allow_list else "an int"
    is_sequence = isinstance(axis, (list, tuple)) and allow_list
    items = list(axis) if is_sequence else [axis]
    if not items or any(
        isinstance(item, bool) or not isinstance(item, numbers.Integral)
        for item in items
    ):
        raise TypeError(
            f"Expected {expected} for the argument `axis`. Received: axis={axis!r}"
        )


def positive_axes(axes, rank: int, input_shape) -> tuple:
    """Return `axes` resolved to non-negative ints, checked against `rank`."""
    if rank == 0:
        raise ValueError(
            "A normalization needs an input with at least one axis to "
            "normalize over; a scalar has none. Pass a tensor of rank >= 1, "
            "e.g. of shape (batch, features). Received: input_shape=()"
        )
    resolved = []
    for axis in axes:
        if not -rank <= axis < rank:
            raise ValueError(
                f"Axis {axis} is out of bounds for an input of rank {rank} "
                f"(input shape {tuple(input_shape)}). Pass axes between {-rank} "
                f"and {rank - 1}. Received: axis={axis}"
            )
        resolved.append(axis % rank)
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            "`axis` names the same dimension twice. Pass each axis once. "
            f"Received: axis={list(axes)} for input shape {tuple(input_shape)}"
        )
    return tuple(resolved)


def check_defined_dims(axes, input_shape, layer_name: str) -> None:
    """Raise ValueError if a weight-carrying axis has an unknown size."""
    for axis in axes:
        if input_shape[axis] is None:
            raise ValueError(
                f"{layer_name} needs the size of axis {axis} to create its "
                "weights, but it is undefined. Give that dimension a fixed size "
                f"in the input. Received: input_shape={tuple(input_shape)}"
            )


def check_float_input(inputs, layer_name: str, argument: str = "inputs") -> None:
    """Raise TypeError unless `inputs` (named `argument`) has a float dtype."""
    dtype = _compat.standardize_dtype(inputs.dtype)
    if "float" not in dtype:
        raise TypeError(
            f"{layer_name} accepts floating-point inputs only. Cast the input "
            "to a float dtype first (e.g. `keras.ops.cast(x, 'float32')`). "
            f"Received: {argument}.dtype={dtype}"
        )


def as_float_input(inputs, layer_name: str, compute_dtype):
    """Return float `inputs` as they are, integer ones in their statistics' dtype.

    Keras's normalization layers take integers (`keras.Input(dtype="int32")`
    features) and compute them in float32; cast to a half-precision compute
    dtype first, values above 65504 (float16) would be inf and above 256
    (bfloat16) rounded. Any other dtype raises TypeError.

    Example:
    >>> import tensorflow as tf
    >>> as_float_input(tf.constant([1, 2]), "LayerNormalization", "float16").dtype
    tf.float32
    """
    dtype = _compat.standardize_dtype(inputs.dtype)
    if "float" in dtype:
        return inputs
    if "int" in dtype or dtype == "bool":
        return tf.cast(inputs, _precision.statistics_dtype(compute_dtype))
    raise TypeError(
        f"{layer_name} accepts floating-point and integer inputs only. Cast the "
        "input to a float dtype first (e.g. `keras.ops.cast(x, 'float32')`). "
        f"Received: inputs.dtype={dtype}"
    )


def check_eager(function_name: str) -> None:
    """Raise RuntimeError when called inside a `tf.function`.

    For the races, which trace, compile and time steps of their own: inside
    a traced function they would time nothing.
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"`{function_name}` times steps of its own and must run eagerly, not "
            "inside a tf.function. Call it outside of any traced function."
        )
