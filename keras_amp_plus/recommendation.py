"""Turn measured matmul speed-ups into a dtype policy recommendation.

The rule is deliberately simple and driven by measurement, not by CPU model:
bfloat16 is recommended when its matmuls are clearly faster than float32 ones
(it needs no loss scaling), float16 only when it is clearly faster still, and
float32 otherwise. When low precision is slower than float32 - CPUs without
AMX-BF16/AVX512-BF16, where TensorFlow emulates bfloat16 (tensorflow issues
42422 and 45441) - the recommendation says so as a warning.
"""

from collections.abc import Mapping

from keras_amp_plus import cpu_features

# A speed-up counts when it is clearly outside the noise of a two-second probe.
FASTER_THRESHOLD = 1.15
SLOWER_THRESHOLD = 0.9


def describe_speedup(speedup: float) -> str:
    """Return `speedup` (low precision / float32 throughput) in words.

    Args:
        speedup: float32 time divided by the low-precision time.

    Example:
    >>> describe_speedup(4.31)
    '4.3x faster than float32'
    >>> describe_speedup(0.4)
    '2.5x slower than float32'
    >>> describe_speedup(1.02)
    'about as fast as float32 (1.02x)'
    """
    if speedup >= FASTER_THRESHOLD:
        return f"{speedup:.1f}x faster than float32"
    if speedup < SLOWER_THRESHOLD:
        return f"{1.0 / speedup:.1f}x slower than float32"
    return f"about as fast as float32 ({speedup:.2f}x)"


def _choose_policy(bfloat16: float | None, float16: float | None) -> str:
    """Return the policy whose matmuls are clearly fastest."""
    bfloat16_fast = bfloat16 is not None and bfloat16 >= FASTER_THRESHOLD
    float16_fast = float16 is not None and float16 >= FASTER_THRESHOLD
    # float16 must also beat bfloat16 clearly: it costs loss scaling.
    if float16_fast and float16 >= (bfloat16 or 0.0) * FASTER_THRESHOLD:
        return "mixed_float16"
    return "mixed_bfloat16" if bfloat16_fast else "float32"


def _summary(bfloat16: float | None, float16: float | None, policy: str) -> str:
    """Return the headline sentence: the chosen policy and the evidence for it."""
    if policy == "mixed_float16":
        return (
            f"float16 matmuls run {describe_speedup(float16)} here "
            f"(bfloat16: {bfloat16 or 0.0:.1f}x): use mixed_float16 with "
            "keras_amp_plus.optimizers.LossScaleOptimizer"
        )
    if bfloat16 is None:
        return "bfloat16 matmuls could not be measured here: keep float32"
    sentence = f"bfloat16 matmuls run {describe_speedup(bfloat16)} here"
    if policy == "mixed_bfloat16":
        return f"{sentence}: use mixed_bfloat16"
    if bfloat16 < SLOWER_THRESHOLD:
        return f"WARNING: {sentence}: keep float32, mixed_bfloat16 would slow training"
    return f"{sentence}: mixed_bfloat16 saves memory, not time; float32 is fine"


def _float16_note(float16: float | None, policy: str) -> str | None:
    """Return the sentence about float16 when it is not the headline, else None."""
    if float16 is None or policy == "mixed_float16":
        return None
    sentence = f"float16 matmuls run {describe_speedup(float16)} here"
    if float16 < SLOWER_THRESHOLD:
        return f"{sentence}: use mixed_float16 to test loss scaling, not for speed"
    return f"{sentence}; bfloat16 needs no loss scaling"


def _hardware_warnings(bfloat16, features, onednn) -> list:
    """Explain a slow bfloat16 result from the CPU flags and the oneDNN switch."""
    warnings = []
    if onednn is False:
        warnings.append(
            "oneDNN is off: TensorFlow's fast bfloat16 and float16 "
            "CPU kernels need it; unset TF_ENABLE_ONEDNN_OPTS or set it to 1"
        )
    slow = bfloat16 is not None and bfloat16 < SLOWER_THRESHOLD
    if slow and cpu_features.has_any(features, cpu_features.BFLOAT16_FLAGS) is False:
        warnings.append(
            "this CPU has neither AMX-BF16 nor AVX512-BF16, so TensorFlow emulates "
            "bfloat16 (tensorflow issues 42422, 45441)"
        )
    return warnings


def _itex_warning(itex_bfloat16: Mapping) -> str:
    """Return the advice where ITEX's bfloat16 kernels abort the process."""
    return (
        "ITEX's bfloat16 kernels do not work on this CPU "
        f"({itex_bfloat16.get('reason')}): with ITEX loaded every bfloat16 "
        "MatMul would abort training. Train in float32 here, or use the "
        "Keras 3 stack (stock TensorFlow) with AMPMonitor(engine='keras') "
        "for mixed precision"
    )


def recommend(
    speedups: Mapping[str, float | None],
    features: Mapping[str, bool] | None = None,
    onednn: bool | None = None,
    fit_uses_xla: bool = False,
    itex_bfloat16: Mapping | None = None,
) -> dict:
    """Recommend a Keras dtype policy from measured matmul speed-ups.

    Args:
        speedups: `{"bfloat16": x, "float16": y}`, each the float32 matmul time
            divided by that dtype's (None or missing when it could not run).
        features: CPU features from `cpu_features.low_precision_features`, used
            to explain a slow result. Defaults to `None` (unknown).
        onednn: whether TensorFlow's oneDNN kernels are on. Defaults to `None`.
        fit_uses_xla: whether Keras would XLA-compile `fit` here. Defaults to
            `False`.
        itex_bfloat16: on the ITEX stack, the bfloat16 probe's answer
            (`{"works", "backend", "reason"}`). Defaults to `None` (no ITEX).

    Returns:
        A dict with `"policy"` (`"float32"`, `"mixed_bfloat16"` or
        `"mixed_float16"`), `"summary"` (one sentence), `"warnings"` and `"notes"`
        (lists of sentences).

    Example:
    >>> advice = recommend({"bfloat16": 4.3, "float16": 0.4})
    >>> advice["summary"]
    'bfloat16 matmuls run 4.3x faster than float32 here: use mixed_bfloat16'
    >>> recommend({"bfloat16": 0.25})["policy"]
    'float32'
    """
    bfloat16, float16 = speedups.get("bfloat16"), speedups.get("float16")
    policy = _choose_policy(bfloat16, float16)
    warnings = _hardware_warnings(bfloat16, features, onednn)
    if fit_uses_xla:
        warnings.append(
            "Keras XLA-compiles `fit` here (jit_compile='auto' -> True): graph AMP "
            "(grappler/ITEX op lists) does not touch XLA functions; pass "
            "jit_compile=False to compile() to use op-level lists"
        )
    notes = []
    if itex_bfloat16 is not None and not itex_bfloat16.get("works"):
        policy = "float32"
        warnings.append(_itex_warning(itex_bfloat16))
    elif itex_bfloat16 is not None:
        notes.append(
            f"ITEX's bfloat16 kernels work here ({itex_bfloat16.get('backend')} "
            "CPU backend): AMPMonitor(engine='itex') turns on its Advanced AMP"
        )
    float16_note = _float16_note(float16, policy)
    if float16_note:
        notes.insert(0, float16_note)
    return {
        "policy": policy,
        "summary": _summary(bfloat16, float16, policy),
        "warnings": warnings,
        "notes": notes,
    }
