"""A run-time switch between normalization paths by the input's size.

In a graph step traced for any batch size (`fit` on a `tf.data` pipeline
without `drop_remainder`), the path measured fastest can change with the
batch size (`_path_choice.paths_by_batch_size`); in one traced for any image
size (a fully convolutional model, `keras.Input((None, None, C))`), with the
sample size and the input's size (`_path_choice.paths_by_sample_size`). The
layer then picks its path at run time with `tf.switch_case`. Left to
autodiff, the switch's
gradient is TensorFlow's cond_v2 gradient: the forward switch hands every
intermediate any branch's gradient needs to the backward switch, which
cost 0.1-0.4 ms a step on 2-core CPUs (`benchmarks/batch_switch.py`), a
tenth of a small instance norm's step. Here the switch carries its own
gradient instead: each path is a forward that returns its output and three
tensors its backward reads (`saved`), and the backward switches between the
paths' backwards with the same index. Differentiated again (nested tapes,
as a gradient penalty takes them), the backward switch is one op whose
gradient is autodiff of a `reference` formula's gradient: TensorFlow
differentiated a switch inside a gradient function to zeros. Every path
computes the same function, so any twice-differentiable one gives the
second-order gradient.
"""

import tensorflow as tf

from keras_amp_plus.layers import _path_choice


def switch_on_batch_size(x, gamma, beta, paths, forward, backward, reference=None):
    """Normalize `x` by the path of its batch size, with an explicit gradient.

    Args:
        x: the input, its batch size unknown at trace time.
        gamma: the scale, as `_fused_normalization.fused_normalize` takes it.
        beta: the offset, like `gamma`.
        paths: `_path_choice.paths_by_batch_size` runs, more than one.
        forward: `forward(path, x, gamma, beta) -> (outputs, saved)`, the
            output by `path` and three tensors of `gamma`'s dtype that
            path's backward reads.
        backward: `backward(path, upstream, x, gamma, saved) -> (x_grad,
            gamma_grad, beta_grad)`.
        reference: `reference(x, gamma, beta) -> outputs`, the same function
            by ops autodiff differentiates twice, for second-order gradients.
            Defaults to None (a second-order gradient raises).

    Returns:
        The normalized `x`, differentiable w.r.t. `x`, `gamma` and `beta`.

    Example:
    >>> import tensorflow as tf
    >>> factor = {"one": 1.0, "two": 2.0}
    >>> def forward(path, x, gamma, beta):
    ...     return factor[path] * x, (gamma, gamma, gamma)
    >>> def backward(path, upstream, x, gamma, saved):
    ...     return factor[path] * upstream, 0 * gamma, 0 * gamma
    >>> paths = ((1, "one"), (3, "two"))  # batches of 3 and more: "two"
    >>> ones, zeros = tf.ones([1, 1]), tf.zeros([1, 1])
    >>> step = tf.function(
    ...     lambda x: switch_on_batch_size(x, ones, zeros, paths, forward, backward),
    ...     input_signature=[tf.TensorSpec([None, 1])])
    >>> [float(step(tf.ones([n, 1]))[0, 0]) for n in (2, 3)]
    [1.0, 2.0]
    """
    distinct = sorted({path for _, path in paths})
    firsts, table = _branch_table(((1, paths),), distinct)  # one row

    def branch_of(x):
        batch = tf.shape(x, out_type=tf.int64)[0]
        return tf.gather(tf.constant(table), _count_reached(firsts, batch))

    return _switch(
        x, gamma, beta, distinct, branch_of, paths, (forward, backward, reference)
    )


def switch_on_sample_size(x, gamma, beta, paths, forward, backward, reference=None):
    """Normalize `x` by the path of its sample size and its size.

    Args:
        x: the input, the size of its samples unknown at trace time.
        gamma: as in `switch_on_batch_size`.
        beta: as in `switch_on_batch_size`.
        paths: `_path_choice.paths_by_sample_size`: `(first sample
            elements, runs)` pairs, each `runs` `(first elements, path)`
            pairs by the input's number of elements.
        forward: as in `switch_on_batch_size`.
        backward: as in `switch_on_batch_size`.
        reference: as in `switch_on_batch_size`. Defaults to None.

    Returns:
        The normalized `x`, differentiable w.r.t. `x`, `gamma` and `beta`.

    Example:
    >>> import tensorflow as tf
    >>> factor = {"one": 1.0, "two": 2.0}
    >>> def forward(path, x, gamma, beta):
    ...     return factor[path] * x, (gamma, gamma, gamma)
    >>> def backward(path, upstream, x, gamma, saved):
    ...     return factor[path] * upstream, 0 * gamma, 0 * gamma
    >>> paths = ((1, ((1, "one"),)), (4, ((1, "two"),)))  # samples of 4 and up
    >>> ones, zeros = tf.ones([1, 1, 1]), tf.zeros([1, 1, 1])
    >>> step = tf.function(
    ...     lambda x: switch_on_sample_size(x, ones, zeros, paths, forward, backward),
    ...     input_signature=[tf.TensorSpec([None, None, 1])])
    >>> [float(step(tf.ones([2, n, 1]))[0, 0, 0]) for n in (3, 4)]
    [1.0, 2.0]
    """
    distinct = sorted({path for _, runs in paths for _, path in runs})
    firsts, table = _branch_table(paths, distinct)

    def branch_of(x):
        dims = tf.shape(x, out_type=tf.int64)
        sample = tf.reduce_prod(dims[1:])
        row = _count_reached(_starts(paths), sample)
        column = _count_reached(firsts, dims[0] * sample)
        return tf.gather(tf.constant(table), row * (len(firsts) + 1) + column)

    return _switch(
        x, gamma, beta, distinct, branch_of, paths, (forward, backward, reference)
    )


def _branch_table(paths, distinct):
    """Return `(firsts, table)`: each sample-size run's branch by size.

    A row per run of sample sizes, a column per run of input sizes over
    every row's thresholds (`firsts`, after 1), flat: two counts and one
    lookup pick a step's branch, the fewest ops the switch runs at each
    step.
    """
    firsts = sorted({first for _, runs in paths for first in _starts(runs)})
    table = [
        distinct.index(_path_at(runs, size))
        for _, runs in paths
        for size in (1, *firsts)
    ]
    return firsts, table


def _starts(runs):
    """Return where the runs of `(first size, value)` pairs after the first start."""
    return [first for first, _ in runs[1:]]


def _count_reached(firsts, size):
    """Return how many of the sizes `firsts` `size` reaches: its run's index."""
    firsts = tf.constant(firsts, tf.int64)
    return tf.reduce_sum(tf.cast(size >= firsts, tf.int32))


def _path_at(runs, size):
    """Return the path of the run of `(first size, path)` pairs holding `size`."""
    return [path for first, path in runs if first <= size][-1]


def _switch(x, gamma, beta, distinct, branch_of, paths, functions):
    """Normalize `x` by `distinct[branch_of(x)]`, with an explicit gradient.

    `functions` is `(forward, backward, reference)`, as the switches take them.
    """
    forward, backward, reference = functions

    @tf.custom_gradient
    def switched(x, gamma, beta):
        branch = branch_of(x)
        # The switch's outputs lose the static shapes the paths' `saved`
        # differ in; each backward gets those of its own forward back.
        saved_shapes = {}
        branches = [
            _forward_branch(forward, path, x, gamma, beta, saved_shapes)
            for path in distinct
        ]
        results = tf.switch_case(branch, branches)
        outputs, saved = results[0], tuple(results[1:])
        outputs.set_shape(x.shape)

        # The backward's inputs are explicit: differentiated again, the
        # gradient reaches x, gamma and beta, not only the upstream gradient.
        @tf.custom_gradient
        def switched_backward(upstream, x, gamma, beta):
            grads = tf.switch_case(
                branch,
                [
                    _backward_branch(
                        backward, path, upstream, x, gamma, saved, saved_shapes
                    )
                    for path in distinct
                ],
            )
            for gradient, like in zip(grads, (x, gamma, beta), strict=True):
                gradient.set_shape(like.shape)
            if reference is None:
                return tuple(grads), _refuse_second_order(paths)
            inputs = (upstream, x, gamma, beta)
            return tuple(grads), _second_order_of(reference, inputs, grads)

        def grad(upstream):
            # Taken into the graph the gradient is built in (a tape around a
            # `tf.function` builds it in a function of its own), so that the
            # tape differentiating it again finds them there.
            here = [tf.identity(t) for t in (x, gamma, beta)]
            return switched_backward(upstream, *here)

        return outputs, grad

    return switched(x, gamma, beta)


def _forward_branch(forward, path, x, gamma, beta, saved_shapes):
    """Return the forward branch of `path`: its output, then its `saved`.

    Each saved tensor leaves the branch with leading axes of size one up to
    one rank (`_saved_rank`): the paths' saved tensors differ in rank, and
    the outputs of a switch whose branches differ in rank break a tape that
    differentiates its gradient again (nested tapes, as a gradient penalty
    takes them). A tensor of that rank leaves as it is: every op here runs
    at each step, and on small inputs the switch's own ops are a measurable
    part of the layer's time. Tracing the branch records the static shapes
    in `saved_shapes[path]`.
    """
    rank = _saved_rank(x)

    def branch():
        outputs, saved = forward(path, x, gamma, beta)
        saved_shapes[path] = [tensor.shape for tensor in saved]
        return (outputs, *(_to_rank(tensor, rank) for tensor in saved))

    return branch


def _to_rank(tensor, rank):
    """Return `tensor` with leading axes of size one up to `rank`.

    One of unknown rank (a kernel's workspace, read flat) leaves flat in its
    last axis.
    """
    own = tensor.shape.rank
    if own == rank:
        return tensor
    if own is None:
        return tf.reshape(tensor, [1] * (rank - 1) + [-1])
    if own > rank:
        raise ValueError(
            "A normalization path saved a tensor of higher rank than the "
            f"switch passes on ({rank}): raise `_saved_rank`. "
            f"Received: shape={tensor.shape}"
        )
    if tensor.shape.is_fully_defined():
        return tf.reshape(tensor, [1] * (rank - own) + tensor.shape.as_list())
    ones = tf.ones([rank - own], tf.int32)
    return tf.reshape(tensor, tf.concat([ones, tf.shape(tensor)], axis=0))


def _from_rank(tensor, static_shape):
    """Undo `_to_rank`: the tensor of `static_shape` (flat if its rank is unknown)."""
    if static_shape.rank is None:
        return tf.reshape(tensor, [-1])
    if tensor.shape == static_shape:
        return tensor
    # A tensor of the branch's own graph (`set_shape` on the captured switch
    # output would narrow it for the other branches too), without the
    # switch output's static shape: under nested tapes TensorFlow gives the
    # switch's outputs one branch's shapes, which another's contradict.
    rank = tensor.shape.rank
    tensor = tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=[None] * rank)
    if static_shape.rank < rank:
        tensor = tf.squeeze(tensor, axis=list(range(rank - static_shape.rank)))
    tensor.set_shape(static_shape)
    return tensor


def _backward_branch(backward, path, upstream, x, gamma, saved, saved_shapes):
    """Return the backward branch of `path`: the three gradients."""

    def branch():
        shaped = tuple(
            _from_rank(tensor, static_shape)
            for tensor, static_shape in zip(saved, saved_shapes[path], strict=True)
        )
        return tuple(backward(path, upstream, x, gamma, shaped))

    return branch


def _second_order_of(reference, inputs, grads):
    """Return the gradient function of the backward switch, by `reference`.

    Autodiff of `reference`'s gradient, recomputed: it runs only when a
    tape differentiates the layer's gradient again.
    """
    upstream, x, gamma, beta = inputs

    def second_order(*grads_of_grads):
        grads_of_grads = [
            tf.zeros_like(g) if d is None else d
            for d, g in zip(grads_of_grads, grads, strict=True)
        ]
        with tf.GradientTape() as outer:
            outer.watch(inputs)
            with tf.GradientTape() as inner:
                inner.watch((x, gamma, beta))
                outputs = reference(x, gamma, beta)
            first = inner.gradient(outputs, (x, gamma, beta), output_gradients=upstream)
        second = outer.gradient(first, inputs, output_gradients=grads_of_grads)
        return [
            tf.zeros_like(value) if gradient is None else gradient
            for gradient, value in zip(second, inputs, strict=True)
        ]

    return second_order


def _refuse_second_order(paths):
    """Return a gradient function that raises: the switch is differentiable once.

    TensorFlow differentiated a switch inside a gradient function to zeros
    (a gradient penalty would then quietly vanish), so differentiating the
    layer's gradient again raises when the tape builds it.
    """

    def second_order(*_):
        raise ValueError(
            "A normalization layer traced for any batch size (or any image "
            "size) switches between its implementations at run time, and its "
            "gradient cannot be differentiated again there (nested "
            "GradientTapes, as a gradient penalty takes them). Trace the step "
            "for a known input shape (batch the tf.data pipeline with "
            "`drop_remainder=True`; give the model's `Input` its image size), "
            "or run one implementation for every size: set "
            f"`{_path_choice.PATH_VARIABLE}` to 'fused_kernels' (or "
            "'keras_formula'). "
            f"Received: paths by size={paths!r}"
        )

    return second_order


def _saved_rank(x):
    """Return the rank every saved tensor leaves a forward branch with."""
    # Every path saves tensors of x's rank at most (rank 2 inputs: 2).
    return max(x.shape.rank, 2)
