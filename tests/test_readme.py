"""The README is the first thing users run: its example, commands and files exist."""

import json
import os
import pathlib
import re
import shlex

import pytest

from keras_amp_plus.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def runnable_blocks(text):
    # The "API in brief" block lists signatures (`kap.layers.Swish(...)`), not code.
    return [block for block in python_blocks(text) if "model.fit(" in block]


def test_readme_example_trains_and_writes_amp_logs(tmp_path, monkeypatch):
    blocks = runnable_blocks(README.read_text())
    assert len(blocks) == 1, "README.md should have one runnable ```python example"
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    model = namespace["model"]
    summary = model.optimizer.overflow_summary()
    # A clean bfloat16 run: the guard (scale fixed at 1) never had to skip a step.
    assert summary["overflow_count"] == 0, summary
    assert summary["loss_scale"] == 1.0
    assert model.optimizer.total_steps.numpy() > 0
    assert (tmp_path / "logs" / "run1" / "amp").is_dir()
    assert any((tmp_path / "logs" / "run1" / "amp").glob("events.out.tfevents.*"))
    events = (tmp_path / "logs" / "run1" / "amp_events.jsonl").read_text()
    assert [json.loads(line) for line in events.splitlines()] == []


def _command_lines(text):
    """Yield the commands of the README's plain ``` (shell) blocks."""
    fence = None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:]
        elif fence == "":
            command = line.split("#")[0].strip()
            if command:
                yield command


@pytest.mark.parametrize(
    "command",
    [c for c in _command_lines(README.read_text()) if "keras_amp_plus" in c],
)
def test_readme_cli_commands_parse(command):
    words = shlex.split(command.split(">")[0])
    # `python` or a virtual environment's (`.venv-itex/bin/python`).
    assert os.path.basename(words[0]) == "python", command
    assert words[1:3] == ["-m", "keras_amp_plus"], command
    build_parser().parse_args(words[3:])  # exits 2 on an unknown option


def test_readme_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z]+):", makefile, flags=re.MULTILINE))
    named = set(re.findall(r"`make (\w+)`|^make (\w+)", README.read_text(), re.M))
    named = {name for pair in named for name in pair if name}
    assert named, "README names no make target"
    assert named <= targets, named - targets


def test_readme_files_exist():
    text = README.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert "docs/tensorboard_amp.png" in images
    paths = images + re.findall(r"`((?:notebooks|scripts)/[\w./]+)`", text)
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, missing


def _listed_scripts(text):
    """Return the scripts a table of the text lists (`| `name.py` | ...`)."""
    return re.findall(r"^\| `(\w+\.py)` \|", text, re.M)


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md"])
def test_benchmark_files_named_in_the_docs_exist(doc):
    # The figures cite the script that measured them and the JSON it wrote.
    text = (ROOT / doc).read_text()
    paths = re.findall(r"`(benchmarks/[\w./-]+\.(?:py|json))", text)
    paths += [f"benchmarks/{name}" for name in _listed_scripts(text)]
    assert paths, f"{doc} cites no benchmark"
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, missing


def test_every_benchmark_script_is_listed():
    listed = set(_listed_scripts((ROOT / "benchmarks/README.md").read_text()))
    scripts = {path.name for path in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - {"machine.py"} == listed
