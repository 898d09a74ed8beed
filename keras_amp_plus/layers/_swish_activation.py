"""Swish: `x * sigmoid(beta * x)` with a memory-saving fused gradient."""

import functools
import numbers

import keras
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import (
    _precision,
    _rounding,
    _row_buckets,
    _swish_calibration,
    _validation,
)
from keras_amp_plus.layers._precision import statistics_dtype

# Inside XLA, inputs from this many elements on recompute the sigmoid in the
# backward pass instead of reading it off the output (float32 or wider
# inputs: recomputing and reading tied from 4M elements on an Intel Xeon with
# AMX, reading won below) or keeping a float32 copy between the passes
# (16 MiB and up): bfloat16 inputs with TensorFlow's
# oneDNN kernels off, whose 32 MiB copy is above glibc's largest mmap
# threshold, so each step maps and faults it in afresh (TensorFlow's
# allocator hands such buffers to the system allocator unless oneDNN's pool
# is on). With oneDNN on, bfloat16 keeps Keras's program, widened: inside a
# model the layer's own forms (kept or recomputed) took 1.13-1.26x its time
# after an instance norm, 0.78-0.90x after a Conv2D, at 1M to 16M elements on
# an AMD EPYC Zen 4 (`benchmarks/swish_in_context.py`), and the CNN of
# `benchmarks/training.py` (Conv2D, instance norm, Swish) ran slower with them.
# float16 inputs on CPUs without float16 arithmetic widen to float32 (as
# bfloat16 ones do) and recompute from 1M elements on: keeping won at 512K
# elements in three runs of `benchmarks/swish_xla.py` on an AMD EPYC Zen 4,
# recomputing from 4M on in all three, at 2M each once and a tie.
# The thresholds where this machine's race is not cached (`_swish_calibration`).
RECOMPUTE_SIGMOID_MIN_ELEMENTS = {
    "float32": 2**22,
    "bfloat16": 2**23,
    "float16": 2**20,
}


def _swish_values(x, beta):
    # XLA keeps the elementwise arithmetic in float32 registers (it widens
    # bfloat16 there anyway); only compute-dtype tensors are read or written,
    # and the result is rounded once, by `_rounding` (XLA's own conversion to
    # bfloat16 made a loop with an exponential much slower).
    x_wide = tf.cast(x, beta.dtype)
    return _rounding.rounded_to(x_wide * tf.sigmoid(beta * x_wide), x.dtype)


@tf.function(jit_compile=True)
def _swish_forward(x, beta):
    return _swish_values(x, beta)


def _swish_gradients(upstream, x, beta, with_beta_grad, gate_of=None):
    """Return the gradients of `x * sigmoid(beta * x)` for x and beta.

    `gate_of(x_wide)` returns `sigmoid(beta * x)` from `x` in `beta`'s
    dtype; by default it is recomputed from x (`tf.sigmoid`) instead of
    being kept from the forward pass: the backward pass needs only x.
    """
    x_wide = tf.cast(x, beta.dtype)
    upstream_wide = tf.cast(upstream, beta.dtype)
    gate = tf.sigmoid(beta * x_wide) if gate_of is None else gate_of(x_wide)
    slope = gate * (1.0 + beta * x_wide * (1.0 - gate))
    x_grad = _rounding.rounded_to(upstream_wide * slope, x.dtype)
    if not with_beta_grad:
        return x_grad, tf.zeros_like(beta)
    beta_grad = tf.reduce_sum(upstream_wide * tf.square(x_wide) * gate * (1.0 - gate))
    return x_grad, beta_grad


@tf.function(jit_compile=True)
def _swish_backward(upstream, x, beta, with_beta_grad):
    return _swish_gradients(upstream, x, beta, with_beta_grad)


def _onednn_forward_applies(x, beta, with_beta_grad, dtypes=(tf.bfloat16,)) -> bool:
    """Return True where oneDNN's fused swish kernel can run the forward pass.

    That is for inputs of one of `dtypes` and a fixed `beta` of 1 in a graph
    step with TensorFlow's oneDNN kernels and grappler's remapper on (on the
    Keras 3 stack: ITEX brings its own graph rewrites). Without the remapper
    the two ops would run unfused: slower, and rounded twice. The remapper
    fuses float32 too, where XLA's kernel was faster for an input of known
    shape; for one of varying shape oneDNN's saves the padding
    (`_swish_of_varying_shape`).
    """
    options = tf.config.optimizer.get_experimental_options()
    remapper_on = options.get("remapping", True) is not False
    grappler_on = not options.get("disable_meta_optimizer", False)
    return (
        x.dtype in dtypes
        and not with_beta_grad
        and tf.get_static_value(beta) == 1.0
        and tf.inside_function()
        and remapper_on
        and grappler_on
        and _compat.ONEDNN_SWISH_FUSION
        and bool(_compat.onednn_enabled())
    )


def _onednn_swish_forward(x):
    # Grappler's remapper fuses exactly this pair into oneDNN's swish kernel
    # (`_MklSwish`), which widens bfloat16 to float32, rounds the result once
    # and ran faster than the XLA kernel at every size of the grid
    # (`benchmarks/layers.py`); the gradient does not use the sigmoid, so
    # nothing keeps it from fusing.
    return x * tf.sigmoid(x)


def _sigmoid_apart(z):
    """`sigmoid(z)` as `1 / (1 + exp(-z / 2) ** 2)`: the same value, other ops.

    XLA merges equal expressions: a backward pass computing `tf.sigmoid(z)`
    as the forward pass does would read the forward's sigmoid, kept in memory
    between the passes, instead of recomputing it. This form is as accurate
    (one exponential, relative error of a few ulps in both tails; `tanh`
    forms lose the lower tail) and XLA cannot merge it with the forward's.
    """
    half = tf.exp(-0.5 * z)
    return 1.0 / (1.0 + half * half)


# Below this magnitude the output says nothing of the sigmoid (it may be
# flushed to zero), which is 0.5 there to within float64's rounding.
_SIGMOID_FROM_OUTPUT_MIN_MAGNITUDE = 1e-30


def _sigmoid_from_output(outputs, x_wide):
    """`sigmoid(beta * x)` as `outputs / x`, for outputs as wide as the arithmetic.

    The output of a layer is in memory anyway (the next layer reads it), so
    the backward pass reading it keeps no tensor of its own between the
    passes and computes no exponential: one division. Rounded once, the
    output holds the sigmoid to within two roundings, as the exponential
    form does; where `x` is about zero, the sigmoid is 0.5.
    """
    outputs_wide = tf.cast(outputs, x_wide.dtype)
    about_zero = tf.abs(x_wide) < _SIGMOID_FROM_OUTPUT_MIN_MAGNITUDE
    ratio = outputs_wide / tf.where(about_zero, tf.ones_like(x_wide), x_wide)
    return tf.where(about_zero, tf.constant(0.5, x_wide.dtype), ratio)


def _output_holds_the_sigmoid(x, beta) -> bool:
    """Return whether the output of `x` is as wide as Swish's arithmetic.

    Then the backward pass reads the sigmoid off it (`_sigmoid_from_output`)
    instead of keeping one; a half-precision output holds it to about 1%.
    """
    return x.dtype.size >= beta.dtype.size


def _recompute_threshold(x) -> int | None:
    """Return the size from which XLA had better recompute the sigmoid, or None.

    Below it, float32 (and wider) inputs read the sigmoid off their output
    (`_sigmoid_from_output`: one more read of a tensor in memory anyway, a
    division); half-precision ones keep it, a float32 tensor (the
    arithmetic's dtype) written in the forward pass and read in the backward
    one. Recomputing it costs one more exponential per element. As measured
    (`benchmarks/layers.py`), the exponential costs more for small inputs (on
    CPUs without AVX-512 most), the memory traffic for large ones: float32
    inputs recompute it from `RECOMPUTE_SIGMOID_MIN_ELEMENTS` on, bfloat16
    inputs (whose own size is
    half the kept sigmoid's) only where TensorFlow's oneDNN kernels are off,
    float16 inputs where the CPU lacks float16 arithmetic. float16 inputs on
    a CPU with it keep it (Keras's formula with a fixed `beta`,
    `_swish_for_xla`): None. Where this machine's race is cached
    (`_swish_calibration`, run by `python -m keras_amp_plus doctor`), its
    threshold replaces the table's.
    """
    family = threshold_family(x.dtype)
    if family is None:
        return None
    if x.dtype == tf.float64:
        # Not raced: float32's measurement says nothing of it.
        return RECOMPUTE_SIGMOID_MIN_ELEMENTS[family]
    return _measured_threshold(family)


def _measured_threshold(family: str) -> int:
    """Return the threshold of `family`: this machine's race, else the table's."""
    default = RECOMPUTE_SIGMOID_MIN_ELEMENTS[family]
    return _swish_calibration.recompute_threshold(family, default)


def sigmoid_thresholds() -> dict:
    """Return the recompute threshold of each input precision that has one here.

    The precisions `_swish_calibration.measure_recompute` races on this
    machine (those whose `threshold_family` is their own), each with the
    threshold a traced step reads (`_recompute_threshold`): the cached race
    where there is one, else `RECOMPUTE_SIGMOID_MIN_ELEMENTS`.

    Returns:
        `{dtype name: threshold in elements}`: float32 always, bfloat16 and
        float16 where they recompute on this machine (they keep the sigmoid
        where the CPU has their kernels).

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> sigmoid_thresholds()["float32"]  # not measured: the table's
    4194304
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    return {
        name: _measured_threshold(name)
        for name in RECOMPUTE_SIGMOID_MIN_ELEMENTS
        if threshold_family(name) == name
    }


def threshold_family(dtype) -> str | None:
    """Return the `RECOMPUTE_SIGMOID_MIN_ELEMENTS` key of `dtype` here, or None.

    None where inputs of `dtype` always keep the sigmoid on this machine
    (`_recompute_threshold`).

    Example:
    >>> threshold_family("float32")
    'float32'
    """
    dtype = tf.as_dtype(dtype)
    if _precision.emulated_float16(dtype):
        return "float16"
    if dtype == tf.float16:
        return None
    wide = dtype.size >= 4  # float32 or float64
    if not wide and _compat.onednn_enabled() is not False:
        return None
    return "float32" if wide else "bfloat16"


def _swish_choosing_backward_sigmoid(x, beta, with_beta_grad, recompute):
    """Swish whose backward pass recomputes the sigmoid or reads the kept one.

    The kept one is the output where it is as wide as the arithmetic
    (`_output_holds_the_sigmoid`), else the forward pass's sigmoid.
    `recompute` is True or False, or for inputs whose size is unknown when
    the step is traced (an unknown batch size, as `fit` traces a `tf.data`
    pipeline) a scalar boolean tensor, whether that size reaches the
    threshold: XLA compiles each input shape with its sizes known, so it
    folds the `tf.cond` away and merges the kept branch's sigmoid with the
    forward pass's, as for a known size. (A size XLA knows only a bound of,
    after a `tf.boolean_mask` say, keeps the conditional: correct, but the
    kept branch then computes its own sigmoid.)
    """

    @tf.custom_gradient
    def swish_with_gradient(x, beta):
        outputs = _swish_values(x, beta)

        def grad(upstream):
            def gradients_with(gate_of):
                return lambda: _swish_gradients(
                    upstream, x, beta, with_beta_grad, gate_of=gate_of
                )

            recomputed = gradients_with(lambda x_wide: _sigmoid_apart(beta * x_wide))
            if _output_holds_the_sigmoid(x, beta):
                kept = gradients_with(functools.partial(_sigmoid_from_output, outputs))
            else:
                kept = gradients_with(None)  # XLA merges it with the forward's
            if recompute is True:
                return recomputed()
            if recompute is False:
                return kept()
            return tf.cond(recompute, recomputed, kept)

        return outputs, grad

    return swish_with_gradient(x, beta)


def _swish_for_xla(x, beta, with_beta_grad):
    """`x * sigmoid(beta * x)` as plain ops, for a model XLA compiles whole.

    There XLA fuses these ops with their neighbours, as it does Keras's own
    activation; the layer's separately compiled kernels would only be
    inlined into the model's cluster and win nothing. The arithmetic runs in
    `beta`'s dtype (float32 or wider) and the result is rounded once (in the
    layer's own forms by `_rounding`). The backward pass recomputes the
    sigmoid from x where that is faster than
    keeping it (`_recompute_threshold`). Elsewhere a float32 (or wider)
    input's backward pass reads it off the output, which the next layer
    reads anyway (Keras's program keeps a copy of its own); a half-precision
    one's keeps it, as TensorFlow's `silu` gradient does, except for float16
    inputs with a fixed `beta` on a CPU with float16 arithmetic
    (AVX512-FP16): there Keras's own formula, in float16, which was faster
    there than widening to float32.
    Without that arithmetic each float16 operation is widened and rounded
    back on its own, and the widened formula was faster.
    """
    threshold = _recompute_threshold(x)
    if threshold is not None:
        elements = x.shape.num_elements()
        if elements is None:
            large = tf.size(x, out_type=tf.int64) >= threshold
            return _swish_choosing_backward_sigmoid(x, beta, with_beta_grad, large)
        if elements >= threshold:
            return _swish_choosing_backward_sigmoid(x, beta, with_beta_grad, True)
    if _output_holds_the_sigmoid(x, beta):
        return _swish_choosing_backward_sigmoid(x, beta, with_beta_grad, False)
    native_float16 = x.dtype == tf.float16 and not _precision.emulated_float16(x.dtype)
    if native_float16 and not with_beta_grad:
        return tf.nn.silu(x, tf.cast(beta, x.dtype))
    return _widened_silu(x, beta)


def _widened_silu(x, beta):
    """`tf.nn.silu` of `x` widened to `beta`'s dtype, in `x`'s dtype: plain ops."""
    return tf.cast(tf.nn.silu(tf.cast(x, beta.dtype), beta), x.dtype)


def _swish_of_varying_shape(x, beta, with_beta_grad):
    """Swish of an input whose shape changes from step to step.

    XLA compiles a kernel per input shape, so the kernels run on `x`
    flattened and padded with zeros to a size bucket (`_row_buckets`: few
    shapes, so few compilations). The forward pass pads `x`, or, where
    oneDNN's fused swish can run it (bfloat16 and float32 with a fixed
    `beta` of 1), runs on `x` itself, unpadded, and leaves the padding to the
    backward pass; an inference step then pays none. The backward pass pads
    the upstream gradient alike. One gradient spans the whole (not one per
    pad and slice), so each pass copies each input at most once, and not at
    all where the size is a bucket. Padded zeros add nothing to `beta`'s
    gradient: their upstream gradient is zero.
    """
    onednn_forward = _onednn_forward_applies(
        x, beta, with_beta_grad, dtypes=(tf.bfloat16, tf.float32)
    )

    @tf.custom_gradient
    def swish_with_gradient(x, beta):
        x_padded = None if onednn_forward else _row_buckets.flat_padded(x)

        def grad(upstream):
            kept = _row_buckets.flat_padded(x) if x_padded is None else x_padded
            x_grad, beta_grad = _swish_backward(
                _row_buckets.flat_padded(upstream), kept, beta, with_beta_grad
            )
            return _row_buckets.unpadded(x_grad, x), beta_grad

        if onednn_forward:
            return _onednn_swish_forward(x), grad
        return _row_buckets.unpadded(_swish_forward(x_padded, beta), x), grad

    return swish_with_gradient(x, beta)


def _swish(x, beta, with_beta_grad):
    if _compat.in_xla_compiled_function():
        return _swish_for_xla(x, beta, with_beta_grad)
    if tf.executing_eagerly():
        # No XLA kernel per eager call's shape (see `fused_normalize`).
        return _widened_silu(x, beta)
    if _row_buckets.shapes_vary(x):
        return _swish_of_varying_shape(x, beta, with_beta_grad)

    onednn_forward = _onednn_forward_applies(x, beta, with_beta_grad)

    @tf.custom_gradient
    def swish_with_gradient(x, beta):
        def grad(upstream):
            return _swish_backward(upstream, x, beta, with_beta_grad)

        if onednn_forward:
            return _onednn_swish_forward(x), grad
        return _swish_forward(x, beta), grad

    return swish_with_gradient(x, beta)


@keras.saving.register_keras_serializable(package="keras_amp_plus")
def swish(x, beta=1.0):
    """Swish activation, `x * sigmoid(beta * x)`, in the input's dtype.

    Usable wherever Keras takes an activation (`activation=swish`; configs
    save it under its registered name `"keras_amp_plus>swish"`), and on
    symbolic `keras.Input` tensors while building a functional model. In
    graph steps the gradient recomputes the sigmoid, so the
    backward pass keeps only `x` (as `tf.nn.silu` does), and forward and
    backward each run as one fused kernel: XLA's, or for bfloat16 with `beta`
    1 in a graph step where TensorFlow's oneDNN kernels are on, oneDNN's
    swish for the forward pass (float32 too where the input's shape varies
    from step to step). Eager calls run plain ops, compiling no kernel for
    each new shape. Inside a `jit_compile=True`
    step it is plain ops, as the `Swish` layer describes.

    Args:
        x: Float input tensor (any float dtype) or `KerasTensor`.
        beta: Finite float (or float tensor) scaling the sigmoid's input.
            Defaults to `1.0`.

    Returns:
        A tensor of the shape and dtype of `x`.

    Example:
    >>> import keras_amp_plus
    >>> import numpy as np
    >>> outputs = keras_amp_plus.layers.swish(np.array([-1.0, 0.0, 2.0], "float32"))
    >>> print(np.round(np.asarray(outputs), 4))
    [-0.2689  0.      1.7616]

    Reference:
    - [Ramachandran et al., 2017](https://arxiv.org/abs/1710.05941).
    """
    beta = _validation.check_swish_beta(beta, allow_tensors=True)
    if _compat.is_keras_tensor(x):
        # Functional model building: record an operation, as Keras's own
        # activations do, which runs this function on real tensors later.
        if _compat.HAS_KERAS_OPERATIONS:
            return _SwishOperation(beta)(x)
        # tf.keras 2 wraps TF ops applied to its KerasTensors in layers of
        # their own, but not a custom gradient: the layer, in x's dtype.
        if not isinstance(beta, numbers.Real):
            raise ValueError(
                "On Keras 2, `keras_amp_plus.layers.swish` applied to a symbolic "
                "`keras.Input` tensor builds a `Swish` layer, whose `beta` is a "
                "number. Pass a float `beta`, or use "
                "`keras_amp_plus.layers.Swish(trainable_beta=True)` for a "
                f"learned one. Received: beta={beta!r}"
            )
        return Swish(beta=beta, dtype=x.dtype.name)(x)
    x = tf.convert_to_tensor(x)
    # The result has x's dtype: integers would come back truncated.
    _validation.check_float_input(x, "swish", argument="x")
    wide = statistics_dtype(x.dtype)
    beta_is_constant = isinstance(beta, numbers.Real)
    return _swish(x, tf.cast(beta, wide), with_beta_grad=not beta_is_constant)


def _unique_name(prefix: str) -> str:
    """Return `prefix`, then `prefix_1`, ...: operation names in a model differ."""
    uid = keras.backend.get_uid(prefix)
    return prefix if uid == 1 else f"{prefix}_{uid - 1}"


if _compat.HAS_KERAS_OPERATIONS:
    # Registered so that a functional model saved with it loads again; under
    # a name of its own, which saved files keep.
    @keras.saving.register_keras_serializable(
        package="keras_amp_plus", name="SwishOperation"
    )
    class _SwishOperation(keras.Operation):
        """`swish` as a Keras operation, for symbolic `KerasTensor` inputs."""

        def __init__(self, beta=1.0, name=None):
            super().__init__(name=name or _unique_name("swish"))
            self.beta = beta

        def get_config(self):
            """Return `beta`, which must be a number to be saved."""
            if not isinstance(self.beta, numbers.Real):
                raise ValueError(
                    "A functional model calling `keras_amp_plus.layers.swish` "
                    "with a tensor `beta` cannot be saved: the config holds "
                    "numbers only. Pass a float `beta`, or use "
                    "`keras_amp_plus.layers.Swish(trainable_beta=True)` for a "
                    f"learned one. Received: beta={self.beta!r}"
                )
            return {"beta": float(self.beta), "name": self.name}

        def call(self, x):
            return swish(x, self.beta)

        def compute_output_spec(self, x):
            _validation.check_float_input(x, "swish", argument="x")
            return keras.KerasTensor(x.shape, dtype=x.dtype)


@keras.saving.register_keras_serializable(package="keras_amp_plus")
class Swish(keras.layers.Layer):
    """Swish activation layer, `x * sigmoid(beta * x)`, optionally Swish-beta.

    Computes in the layer's compute dtype: inputs are cast to it, outputs and
    input gradients have it, and in graph steps no float32 tensor is ever
    written to memory (eager calls run plain ops, as Keras's activation).
    Inside each fused XLA kernel the arithmetic runs in float32 registers (XLA
    widens bfloat16 there anyway), so each result is rounded once; so does
    oneDNN's swish kernel, which runs the bfloat16 forward pass with the
    default `beta` in graph steps where TensorFlow's oneDNN kernels are on
    (grappler fuses `x * sigmoid(x)` into it; the float32 one too where the
    input's length varies). Inside a model compiled with `jit_compile=True`
    the layer is plain ops XLA fuses with its neighbours (float16 with a fixed
    `beta` on a CPU with float16 arithmetic: Keras's formula, in float16, as
    `Activation("swish")`). In graph steps the
    gradient recomputes the sigmoid instead of storing it, so a training step
    keeps no more than `Activation("swish")` does. Inside a compiled model
    the backward pass recomputes it only for inputs large enough that this
    was faster (`_recompute_threshold`; XLA knows every size); elsewhere a
    float32 input's backward pass reads the sigmoid off the output (one
    division), and a half-precision one's keeps it between the passes, in
    float32 (where float16 runs Keras's formula: in float16), as that was
    faster. XLA
    compiles a kernel per input shape, so inputs whose length changes from
    batch to batch are padded to one of two sizes per power of two (bounded
    compilations). With
    `trainable_beta=True`, `beta` is one trainable float32 weight (Swish-beta)
    initialized to `beta`.

    Args:
        beta: Finite float, the sigmoid's input scale (the initial value
            when trainable). Defaults to `1.0`.
        trainable_beta: Bool; if True, learn `beta`. Defaults to `False`.
        **kwargs: Base layer keyword arguments (`name`, `dtype`, ...).

    Example:
    >>> import numpy as np
    >>> import keras_amp_plus
    >>> layer = keras_amp_plus.layers.Swish(trainable_beta=True, dtype="mixed_bfloat16")
    >>> outputs = layer(np.array([[-1.0, 0.0, 2.0]]))
    >>> print(outputs.dtype.name, layer.beta.dtype)
    bfloat16 float32
    >>> print(np.asarray(outputs, dtype="float32"))  # bfloat16 values
    [[-0.26953125  0.          1.7578125 ]]

    Reference:
    - [Ramachandran et al., 2017](https://arxiv.org/abs/1710.05941).
    """

    def __init__(self, beta: float = 1.0, trainable_beta: bool = False, **kwargs):
        beta = _validation.check_swish_beta(beta, allow_tensors=False)
        trainable_beta = _validation.check_bool(trainable_beta, "trainable_beta")
        super().__init__(**kwargs)
        self.initial_beta = beta
        self.trainable_beta = trainable_beta
        self.supports_masking = True

    def build(self, input_shape):
        """Create the trainable float32 `beta` when `trainable_beta` is set."""
        if self.trainable_beta:
            self.beta = self.add_weight(
                name="beta",
                shape=(),
                initializer=keras.initializers.Constant(self.initial_beta),
                dtype="float32",
                **_compat.no_autocast(),
            )
        else:
            self.beta = None
        self.built = True  # Keras 2 builds again on the first call otherwise

    def call(self, inputs):
        """Return `inputs * sigmoid(beta * inputs)` in the compute dtype."""
        _validation.check_float_input(inputs, "Swish")
        wide = statistics_dtype(inputs.dtype)
        if self.beta is None:
            return _swish(inputs, tf.constant(self.initial_beta, wide), False)
        return _swish(inputs, tf.cast(self.beta, wide), True)

    def compute_output_shape(self, input_shape):
        """Return `input_shape`: the activation keeps the shape."""
        return input_shape

    @classmethod
    def from_config(cls, config):
        """Create the layer from its config, as saved by Keras 3 or Keras 2."""
        return super().from_config(_compat.portable_layer_config(config))

    def build_from_config(self, config):
        """Build the layer as saved, its weights named after it (Keras 2 too)."""
        _compat.build_from_config(self, config, super().build_from_config)

    def get_config(self):
        """Return `beta` (the initial value) and `trainable_beta`."""
        config = {"beta": self.initial_beta, "trainable_beta": self.trainable_beta}
        return {**super().get_config(), **config}
