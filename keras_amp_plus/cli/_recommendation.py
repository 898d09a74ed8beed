"""Turn the machine's facts into a dtype policy recommendation.

The bfloat16 verdict is `keras_amp_plus._hardware.speedup_verdict`, the one
`AMPMonitor` uses too: where the hardware decides (no bfloat16 instructions,
or oneDNN off) it follows the hardware, elsewhere the measured matmul speed-up
with a band of "no clear difference" around 1x, so the advice does not flip
from run to run. float16 is recommended only when it is clearly faster than
bfloat16 too (it costs loss scaling).
"""

from collections.abc import Mapping

from keras_amp_plus import _hardware

FASTER_THRESHOLD = _hardware.FASTER_THRESHOLD
SLOWER_THRESHOLD = _hardware.SLOWER_THRESHOLD
FLOAT32_INSTEAD = (
    "train in float32 (keras_amp_plus's layers are faster than Keras's in "
    "float32 too); bfloat16 pays on CPUs with AMX-BF16 or AVX512-BF16 (Intel "
    "Xeon 4th generation and later) with oneDNN on"
)


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
    if speedup <= SLOWER_THRESHOLD:
        return f"{1.0 / speedup:.1f}x slower than float32"
    return f"about as fast as float32 ({speedup:.2f}x)"


def _choose_policy(verdict: str, bfloat16, float16) -> str:
    """Return the policy: bfloat16 when it pays, float16 only when clearly faster."""
    float16_fast = float16 is not None and float16 >= FASTER_THRESHOLD
    if float16_fast and float16 >= (bfloat16 or 0.0) * FASTER_THRESHOLD:
        return "mixed_float16"
    return "mixed_bfloat16" if verdict == "faster" else "float32"


def _instead(features, onednn) -> str:
    """Return what to do instead of a slow mixed_bfloat16."""
    capable = _hardware.has_any(features, _hardware.BFLOAT16_FLAGS)
    if capable and onednn is False:
        return (
            "this CPU has bfloat16 instructions: set TF_ENABLE_ONEDNN_OPTS=1 "
            "before TensorFlow is imported, or train in float32"
        )
    return FLOAT32_INSTEAD


def _summary(verdict, bfloat16, float16, policy, reason, instead) -> str:
    """Return the headline sentence: the chosen policy and the evidence for it."""
    if policy == "mixed_float16":
        return (
            f"float16 matmuls run {describe_speedup(float16)} here "
            f"(bfloat16: {bfloat16 or 0.0:.1f}x): use mixed_float16 with "
            "keras_amp_plus.optimizers.LossScaleOptimizer"
        )
    if verdict == "slower":
        return (
            f"WARNING: mixed_bfloat16 would slow training here: {reason}. "
            f"Instead, {instead}"
        )
    if bfloat16 is None:
        if verdict == "faster":
            return "this CPU has bfloat16 instructions and oneDNN: use mixed_bfloat16"
        return "bfloat16 matmuls could not be measured here: keep float32"
    sentence = f"bfloat16 matmuls run {describe_speedup(bfloat16)} here"
    if policy == "mixed_bfloat16":
        return f"{sentence}: use mixed_bfloat16"
    return (
        f"{sentence}, no clear difference: mixed_bfloat16 saves memory, not "
        "time; float32 is fine"
    )


def _float16_note(float16: float | None, policy: str) -> str | None:
    """Return the sentence about float16 when it is not the headline, else None."""
    if float16 is None or policy == "mixed_float16":
        return None
    sentence = f"float16 matmuls run {describe_speedup(float16)} here"
    if float16 <= SLOWER_THRESHOLD:
        return f"{sentence}: use mixed_float16 to test loss scaling, not for speed"
    return f"{sentence}; bfloat16 needs no loss scaling"


def _onednn_warning(features, onednn, onednn_env) -> str | None:
    """Return advice about the oneDNN switch that fits what the environment holds."""
    if onednn is not False:
        return None
    if onednn_env is None:
        how = "it is off by default on this CPU; set TF_ENABLE_ONEDNN_OPTS=1"
    else:
        how = f"TF_ENABLE_ONEDNN_OPTS={onednn_env} turns it off; set it to 1"
    sentence = (
        f"oneDNN is off ({how} before TensorFlow is imported): the grappler "
        "engine's bfloat16 rewrite needs it"
    )
    if _hardware.has_any(features, _hardware.BFLOAT16_FLAGS) is False:
        sentence += ", but on this CPU it will not make bfloat16 fast"
    else:
        sentence += ", and so do TensorFlow's fast bfloat16 CPU kernels"
    return sentence


ALLOCATOR_VARIABLE = _hardware.ALLOCATOR_VARIABLE


def _allocator_note(onednn, allocator_env) -> str | None:
    """Return advice about TensorFlow's CPU allocator where oneDNN is off.

    Without oneDNN TensorFlow allocates CPU tensors with `malloc`, and glibc
    maps large blocks afresh on every step; oneDNN's allocator, and
    TensorFlow's BFC one, pool them (`benchmarks/cpu_allocator.py`).

    Example:
    >>> _allocator_note(onednn=True, allocator_env=None) is None
    True
    >>> _allocator_note(onednn=False, allocator_env=None).split(":")[0]
    'set TF_CPU_ALLOCATOR_USE_BFC=1 before TensorFlow is imported'
    """
    if onednn is not False or allocator_env is not None:
        return None
    return (
        f"set {ALLOCATOR_VARIABLE}=1 before TensorFlow is imported: with oneDNN "
        "off TensorFlow allocates tensors with malloc, which maps tensors of "
        "16 MiB and more afresh (and page-faults them in) on every step; the "
        "BFC allocator pools them, and steps on large tensors, Keras's layers' "
        "and ours, run faster (see benchmarks/README.md)"
    )


def _itex_warning(itex_bfloat16: Mapping) -> str:
    """Return the advice where ITEX's bfloat16 kernels abort the process."""
    return (
        "ITEX's bfloat16 kernels do not work on this CPU "
        f"({itex_bfloat16.get('reason')}): with ITEX loaded every bfloat16 "
        "MatMul would abort training. Train in float32 here, or use the "
        "Keras 3 stack (stock TensorFlow) with AMPMonitor(engine='keras') "
        "for mixed precision"
    )


def jit_advice(jit_probe: Mapping | None) -> tuple:
    """Return (whether to pass `jit_compile=True`, the sentence saying why).

    Only a measured, clear speed-up recommends it; no measurement, a failed
    one or a speed-up inside the noise band keeps Keras's CPU default (off).

    Args:
        jit_probe: `keras_amp_plus.cli._jit_probe.probe_jit_speedup`'s result,
            or None when it did not run.

    Example:
    >>> jit_advice({"policy": "mixed_bfloat16", "speedup": 1.4})[0]
    True
    >>> jit_advice({"policy": "float32", "speedup": 0.8})[1].split(": ")[-1]
    'keep jit_compile=False'
    """
    if jit_probe is None:
        return None, None
    policy = jit_probe.get("policy")
    speedup = jit_probe.get("speedup")
    if speedup is None:
        return None, (
            f"jit_compile=True could not be measured here ({policy}: "
            f"{jit_probe.get('error')}): keep jit_compile=False"
        )
    if speedup >= FASTER_THRESHOLD:
        return True, (
            f"a training step with jit_compile=True ran {speedup:.1f}x faster "
            f"than without here ({policy}): pass jit_compile=True to compile()"
        )
    if speedup <= SLOWER_THRESHOLD:
        how = f"{1.0 / speedup:.1f}x slower than"
    else:
        how = f"about as fast as ({speedup:.2f}x)"
    return False, (
        f"a training step with jit_compile=True ran {how} without here "
        f"({policy}): keep jit_compile=False"
    )


def _itex_note(itex_bfloat16: Mapping, verdict: str) -> str:
    """Say that ITEX's bfloat16 kernels run here, and whether they pay."""
    backend = itex_bfloat16.get("backend")
    works = f"ITEX's bfloat16 kernels work here ({backend} CPU backend)"
    if verdict == "slower":
        # The kernels run, but emulated: ITEX's rewrite would slow training.
        return (
            f"{works}, but bfloat16 runs slower than float32 on this CPU: "
            "AMPMonitor(engine='itex') would train slower than float32"
        )
    return f"{works}: AMPMonitor(engine='itex') turns on its Advanced AMP"


def recommend(
    speedups: Mapping[str, float | None],
    features: Mapping[str, bool] | None = None,
    onednn: bool | None = None,
    fit_uses_xla: bool = False,
    onednn_env: str | None = None,
    itex_bfloat16: Mapping | None = None,
    jit_probe: Mapping | None = None,
    allocator_env: str | None = None,
) -> dict:
    """Recommend a Keras dtype policy from the machine's facts.

    Args:
        speedups: `{"bfloat16": x, "float16": y}`, each the float32 matmul time
            divided by that dtype's (None or missing when it could not run).
        features: CPU features from `_hardware.low_precision_features`.
            Defaults to `None` (unknown).
        onednn: whether TensorFlow's oneDNN kernels are on. Defaults to `None`.
        fit_uses_xla: whether Keras would XLA-compile `fit` here. Defaults to
            `False`.
        onednn_env: the value of `TF_ENABLE_ONEDNN_OPTS` (None when unset),
            so the advice names the right fix. Defaults to `None`.
        itex_bfloat16: on the ITEX stack, the bfloat16 probe's answer
            (`{"works", "backend", "reason"}`). Defaults to `None` (no ITEX).
        jit_probe: the measured training step with `jit_compile` off and on
            (`keras_amp_plus.cli._jit_probe.probe_jit_speedup`). Defaults to
            `None` (not measured: no advice about `jit_compile`).
        allocator_env: the value of `TF_CPU_ALLOCATOR_USE_BFC` (None when
            unset): with oneDNN off and it unset, a note to set it. Defaults
            to `None`.

    Returns:
        A dict with `"policy"` (`"float32"`, `"mixed_bfloat16"` or
        `"mixed_float16"`), `"verdict"` (bfloat16 vs float32: "faster",
        "slower", "no clear difference" or "unknown"), `"jit_compile"`
        (True where it measured clearly faster, False where not, None when
        unmeasured), `"summary"` (one sentence), `"warnings"` and `"notes"`
        (lists of sentences).

    Example:
    >>> advice = recommend({"bfloat16": 4.3, "float16": 0.4})
    >>> advice["summary"]
    'bfloat16 matmuls run 4.3x faster than float32 here: use mixed_bfloat16'
    >>> recommend({"bfloat16": 0.25})["policy"]
    'float32'
    """
    bfloat16, float16 = speedups.get("bfloat16"), speedups.get("float16")
    verdict = _hardware.speedup_verdict(bfloat16, features, onednn)
    policy = _choose_policy(verdict, bfloat16, float16)
    reason = _hardware.slow_bfloat16_reason(features, onednn, bfloat16)
    warnings = [w for w in [_onednn_warning(features, onednn, onednn_env)] if w]
    if fit_uses_xla:
        warnings.append(
            "Keras XLA-compiles `fit` here (jit_compile='auto' -> True): graph AMP "
            "(grappler/ITEX op lists) does not touch XLA functions; pass "
            "jit_compile=False to compile() to use op-level lists"
        )
    jit_compile, jit_note = jit_advice(jit_probe)
    notes = [
        note
        for note in [
            _float16_note(float16, policy),
            jit_note,
            _allocator_note(onednn, allocator_env),
        ]
        if note
    ]
    if itex_bfloat16 is not None and not itex_bfloat16.get("works"):
        policy = "float32"
        warnings.append(_itex_warning(itex_bfloat16))
    elif itex_bfloat16 is not None:
        notes.append(_itex_note(itex_bfloat16, verdict))
    return {
        "policy": policy,
        "verdict": verdict,
        "jit_compile": jit_compile,
        "summary": _summary(
            verdict, bfloat16, float16, policy, reason, _instead(features, onednn)
        ),
        "warnings": warnings,
        "notes": notes,
    }
