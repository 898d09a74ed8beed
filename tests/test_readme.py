"""The README's example is the first code users run: it must run as written."""

import json
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_example_trains_and_writes_amp_logs(tmp_path, monkeypatch):
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python example"
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    model = namespace["model"]
    assert model.optimizer.overflow_summary()["overflow_count"] >= 0
    assert (tmp_path / "logs" / "run1" / "amp").is_dir()
    events = (tmp_path / "logs" / "run1" / "amp_events.jsonl").read_text()
    for line in events.splitlines():
        json.loads(line)
