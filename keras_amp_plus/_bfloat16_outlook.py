"""Whether bfloat16 pays on this machine: the one verdict doctor and AMPMonitor share.

"faster", "slower", "no clear difference" or "unknown", from the CPU's
features (`_hardware`), a cached matmul probe (`_matmul_probe`) and, where ITEX
is loaded, whether its bfloat16 kernels run here at all (`_itex_probe`): see
`_hardware`'s module docstring for how the hardware and the probe decide.
"""

import tensorflow as tf

from keras_amp_plus import _compat, _hardware, _itex_probe, _matmul_probe


def _itex_bfloat16_refusal() -> str | None:
    """Return why ITEX's bfloat16 kernels cannot run here, or None.

    Only where ITEX imports; the answer comes from a cached subprocess probe.
    """
    if _compat.itex_module() is None:
        return None
    status = _itex_probe.itex_bfloat16_status()
    if status["works"]:
        return None
    return f"ITEX's bfloat16 kernels abort the process here ({status['reason']})"


def bfloat16_outlook(probe: dict | None = None, measure: bool = True) -> dict:
    """Return the bfloat16 verdict for this machine (see the module docstring).

    Args:
        probe: a fresh `_matmul_probe.probe_matmul_throughput` result to use
            (and cache), e.g. the doctor's. Defaults to None: the cached
            figure, else a short probe when `measure` is True and the
            hardware leaves any doubt.
        measure: whether a missing figure may be measured. Defaults to True.

    Returns:
        `{"verdict", "speedup", "reason", "cpu", "onednn"}`; `reason` is a
        sentence when the verdict is "slower", else None.
    """
    facts, onednn = _hardware.cpu_facts(), _compat.onednn_enabled()
    itex_refusal = _itex_bfloat16_refusal()
    if itex_refusal is not None:
        # With ITEX loaded an in-process bfloat16 MatMul would abort Python.
        return {
            "verdict": "slower",
            "speedup": None,
            "reason": itex_refusal,
            "cpu": facts,
            "onednn": onednn,
        }
    path = _hardware._probe_cache_path(facts, tf.__version__, onednn)
    speedup = None
    if probe is not None:
        speedup = probe["results"].get("bfloat16", {}).get("speedup_vs_float32")
        _hardware.write_cached_speedup(path, speedup)
    else:
        speedup = _hardware.read_cached_speedup(path)
        features = facts["features"]
        fast_hardware = _hardware.has_any(features, _hardware.BFLOAT16_FLAGS) and onednn
        if speedup is None and measure and not fast_hardware:
            quick = _matmul_probe.probe_matmul_throughput(
                dtypes=("float32", "bfloat16"), **_hardware.QUICK_PROBE
            )
            return bfloat16_outlook(probe=quick, measure=False)
    verdict = _hardware.speedup_verdict(speedup, facts["features"], onednn)
    reason = None
    if verdict == "slower":
        reason = _hardware.slow_bfloat16_reason(facts["features"], onednn, speedup)
    return {
        "verdict": verdict,
        "speedup": speedup,
        "reason": reason,
        "cpu": facts,
        "onednn": onednn,
    }
