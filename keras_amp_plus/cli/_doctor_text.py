"""Render the doctor's facts (`keras_amp_plus.cli._doctor.gather_facts`) as text."""

from keras_amp_plus import _hardware, _itex_probe


def _yes_no(value) -> str:
    """Return "yes", "no" or "unknown" for True, False or None."""
    return {True: "yes", False: "no"}.get(value, "unknown")


def _itex_line(itex: dict) -> str:
    """Return ITEX's version and whether it can be used on this stack."""
    if itex["version"] is None:
        return "not installed"
    if not itex["importable"]:
        return f"{itex['version']} (not importable on this stack)"
    bfloat16 = itex.get("bfloat16")
    if bfloat16 is None:
        return f"{itex['version']} (importable)"
    backend = f"{bfloat16['backend']} CPU backend" if bfloat16["backend"] else ""
    kernels = (
        "bfloat16 kernels work"
        if bfloat16["works"]
        else f"bfloat16 kernels do not work: {bfloat16['reason']}"
    )
    for dtype in _itex_probe.LAYER_NORM_PROBE_DTYPES:
        layer_norm = itex.get(f"{dtype}_layer_norm")
        if layer_norm is not None and not layer_norm["works"]:
            kernels += (
                f"; {dtype} layer norm does not work ({layer_norm['reason']}): "
                f"LayerNormalization runs its own kernels in {dtype}"
            )
    details = ", ".join(part for part in (backend, kernels) if part)
    return f"{itex['version']} (importable; {details})"


def _onednn_line(onednn: dict) -> str:
    """Return the oneDNN switch and the environment variable behind it."""
    env = onednn["TF_ENABLE_ONEDNN_OPTS"]
    source = "unset, TF's default" if env is None else f"={env}"
    state = {True: "on", False: "off"}.get(onednn["enabled"], "unknown")
    return f"{state} (TF_ENABLE_ONEDNN_OPTS {source})"


def _cpu_line(cpu: dict) -> str:
    """Return the CPU's name, with its family and model where known."""
    name = cpu["model"] or f"{cpu['system']} {cpu['machine']}"
    signature = cpu.get("signature")
    return f"{name} ({signature})" if signature else name


def _features_line(cpu: dict) -> str:
    """Return the low-precision CPU features, or why they are unknown."""
    features = cpu["features"]
    if features is None:
        return f"unknown (no /proc/cpuinfo on {cpu['system']})"
    return ", ".join(
        f"{label} {_yes_no(features[flag])}"
        for flag, label in _hardware.LOW_PRECISION_FLAGS.items()
    )


def _xla_line(xla: dict) -> str:
    """Return whether `fit` is XLA-compiled and what that means for graph AMP."""
    default = f"jit_compile={xla.get('default', 'auto')!r}"
    if xla["jit_compile"]:
        return f"yes ({default} -> True): graph AMP does not apply"
    return f"no ({default} -> False): graph AMP applies"


def _probe_lines(probe: dict) -> list:
    """Return the probe's table: one row per dtype."""
    basis = probe.get("speedup_basis", "cpu_time").replace("_", " ")
    lines = [
        f"Matmul probe ({probe['size']}x{probe['size']}, about "
        f"{probe['seconds']:g} s, medians of interleaved rounds)",
        f"  {'dtype':<10}{'ms/matmul':>11}{'TFLOP/s':>10}{'CPU ms':>9}"
        f"{'vs float32 (' + basis + ')':>26}",
    ]
    for dtype, result in probe["results"].items():
        if "error" in result:
            lines.append(f"  {dtype:<10}  not available: {result['error'][:60]}")
            continue
        speedup = result.get("speedup_vs_float32")
        ratio = "-" if speedup is None else f"{speedup:.2f}x"
        lines.append(
            f"  {dtype:<10}{result['wall_ms']:>11.2f}{result['tflops']:>10.3f}"
            f"{result['cpu_ms']:>9.2f}{ratio:>26}"
        )
    return lines


def _jit_probe_line(jit_probe: dict | None) -> str:
    """Return the jit probe's figures: CPU ms per step off and on."""
    if jit_probe is None:
        return "not measured"
    if "error" in jit_probe:
        return f"{jit_probe['policy']}: not available: {jit_probe['error'][:60]}"
    return (
        f"{jit_probe['policy']}: {jit_probe['graph_ms']:.1f} CPU ms per step "
        f"without, {jit_probe['jit_ms']:.1f} with jit_compile=True "
        f"({jit_probe['speedup']:.2f}x, {jit_probe['rounds']} rounds)"
    )


def _layer_paths_line(layer_paths: dict | None) -> str:
    """Return how many measured graph-step cells (shape, batch) each path won."""
    unmeasured = _unmeasured_line(layer_paths)
    if unmeasured:
        return unmeasured
    cells = layer_paths["cells"]
    wins = {}
    for cell in cells:
        wins[cell["path"]] = wins.get(cell["path"], 0) + 1
    counts = ", ".join(f"{path} {count}" for path, count in sorted(wins.items()))
    when = "measured now" if layer_paths["measured_now"] else "cached"
    return f"fastest at {len(cells)} cells: {counts or 'none'} ({when})"


def _swish_sigmoid_line(swish: dict | None) -> str:
    """Return from which size Swish recomputes its sigmoid inside XLA, per dtype."""
    unmeasured = _unmeasured_line(swish)
    if unmeasured:
        return unmeasured
    if not swish["thresholds"]:  # no precision here has a threshold
        return "keeps the sigmoid in every precision here"
    when = "measured now" if swish["measured_now"] else "cached"
    when = when if swish["cells"] else "not measured: the defaults"
    # Imports TensorFlow: not before the doctor has checked the stack.
    from keras_amp_plus.layers._swish_calibration import NEVER

    recomputed = {
        name: count for name, count in swish["thresholds"].items() if count < NEVER
    }
    kept = [name for name in swish["thresholds"] if name not in recomputed]
    if not recomputed:
        return f"never recomputes the sigmoid here{_kept_note(kept)} ({when})"
    sizes = ", ".join(
        f"{name} from {_elements(count)}" for name, count in recomputed.items()
    )
    return f"recomputes the sigmoid: {sizes} elements{_kept_note(kept)} ({when})"


def _kept_note(names) -> str:
    """Return what Swish's backward pass reads instead, for precisions `names`.

    A float32 output holds the sigmoid (`_swish_activation._sigmoid_from_output`);
    half-precision inputs keep a float32 copy between the passes.
    """
    kept = [name for name in names if name != "float32"]
    parts = [f"keeps it in {', '.join(kept)}"] if kept else []
    if "float32" in names:
        parts.append("reads it off the output in float32")
    return "".join(f"; {part}" for part in parts)


def _xla_sums_line(xla_sums: dict | None) -> str:
    """Return where instance norm inside XLA sums by products, per dtype."""
    unmeasured = _unmeasured_line(xla_sums)
    if unmeasured:
        return unmeasured
    cells = xla_sums["cells"]
    if not cells:
        return "products everywhere (not measured: the default)"
    dtypes = sorted({cell["dtype"] for cell in cells})
    parts = []
    for name in dtypes:
        won = [cell for cell in cells if cell["dtype"] == name]
        products = sum(cell["ratio"] < 1.0 for cell in won)
        parts.append(f"{name} {products}/{len(won)}")
    when = "measured now" if xla_sums["measured_now"] else "cached"
    return f"batched products won at {', '.join(parts)} sizes ({when})"


def _cache_line(cache: dict | None) -> str:
    """Return where the measurements are cached, or why they are not."""
    if cache is None:
        return "unknown"
    if cache["writable"]:
        return f"{cache['dir']} (per CPU model, TensorFlow version and oneDNN)"
    return (
        f"{cache['dir']} is not writable: every run measures again (set "
        f"{_hardware.CACHE_DIR_VARIABLE} to a writable directory)"
    )


def _unmeasured_line(status: dict | None) -> str | None:
    """Return why a race's `status` holds no measurement, or None if it may."""
    if status is None:
        return "not measured"
    if status.get("skipped"):
        return f"not measured: {status['skipped']}"
    return None


def _elements(count: int) -> str:
    """Return `count` as `512K`, `2M`, ... (powers of two), else the number."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if count >= size and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


def render(facts: dict) -> str:
    """Return the doctor's report as plain text.

    Args:
        facts: the dict returned by `keras_amp_plus.cli._doctor.gather_facts`.
    """
    versions, cpu = facts["versions"], facts["cpu"]
    devices = ", ".join(
        d["name"].replace("/physical_device:", "") for d in facts["devices"]
    )
    rows = [
        ("Python", versions["python"]),
        ("TensorFlow", versions["tensorflow"]),
        ("Keras", f"{versions['keras']} (backend: {versions['keras_backend']})"),
        ("keras_amp_plus", versions["keras_amp_plus"]),
        ("ITEX", _itex_line(versions["itex"])),
        ("oneDNN", _onednn_line(facts["onednn"])),
        ("CPU", _cpu_line(cpu)),
        ("CPU features", _features_line(cpu)),
        ("Devices", devices or "none"),
        ("XLA in fit", _xla_line(facts["xla"])),
        ("jit probe", _jit_probe_line(facts.get("jit_probe"))),
        ("Layer paths", _layer_paths_line(facts.get("layer_paths"))),
        ("Swish in XLA", _swish_sigmoid_line(facts.get("swish_sigmoid"))),
        ("IN sums in XLA", _xla_sums_line(facts.get("xla_sums"))),
        ("Cache", _cache_line(facts.get("cache"))),
    ]
    lines = ["keras_amp_plus doctor", ""]
    lines += [f"  {label:<16}{value}" for label, value in rows]
    lines += ["", *_probe_lines(facts["probe"]), "", "Recommendation"]
    advice = facts["recommendation"]
    lines.append(f"  {advice['summary']}")
    lines += [f"  WARNING: {warning}" for warning in advice["warnings"]]
    lines += [f"  note: {note}" for note in advice["notes"]]
    return "\n".join(lines)
