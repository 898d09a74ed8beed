"""Checks of argument types every part of the package shares (the bottom layer).

Each raises a Keras-style error naming the argument, what was expected and
what was received, before the caller changes anything.
"""

import numbers
import os

import keras


def is_int(value) -> bool:
    """Return True for an integer that is not a bool.

    Example:
    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Return True for a real number that is not a bool.

    Example:
    >>> is_real(0.5), is_real(False)
    (True, False)
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_model(value, function: str, argument: str = "model") -> None:
    """Raise a TypeError unless `value` is a `keras.Model`.

    Args:
        value: the argument received.
        function: the public function checking it, for the message.
        argument: the argument's name. Defaults to `"model"`.

    Example:
    >>> require_model("m", "precision_report")
    Traceback (most recent call last):
    ...
    TypeError: `precision_report` expects a Keras model as `model`, such as a `keras.Sequential` or a functional `keras.Model`. Received: model='m' of type str
    """  # noqa: E501
    if not isinstance(value, keras.Model):
        raise TypeError(
            f"`{function}` expects a Keras model as `{argument}`, such as a "
            "`keras.Sequential` or a functional `keras.Model`. Received: "
            f"{argument}={value!r} of type {type(value).__name__}"
        )


def require_layer(value, function: str) -> None:
    """Raise a TypeError unless `value` is a `keras.layers.Layer`.

    Example:
    >>> require_layer(keras.layers.Dense(2), "op_types_for_layer")
    """
    if not isinstance(value, keras.layers.Layer):
        raise TypeError(
            f"`{function}` expects a Keras layer, such as `model.get_layer(name)`. "
            f"Received: layer={value!r} of type {type(value).__name__}"
        )


def require_path(value, argument: str, allow_none: bool = True) -> None:
    """Raise a TypeError unless `value` is a path (a str or os.PathLike).

    Example:
    >>> require_path(None, "log_dir")
    >>> require_path(3, "log_dir")
    Traceback (most recent call last):
    ...
    TypeError: `log_dir` must be a directory path (a str or os.PathLike) or None. Received: log_dir=3 of type int
    """  # noqa: E501
    if (allow_none and value is None) or isinstance(value, (str, os.PathLike)):
        return
    expected = "a directory path (a str or os.PathLike)"
    raise TypeError(
        f"`{argument}` must be {expected}{' or None' if allow_none else ''}. "
        f"Received: {argument}={value!r} of type {type(value).__name__}"
    )
