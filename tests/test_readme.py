"""The README's examples run as written, in order, each continuing the one before (as in a session)."""

import re
from pathlib import Path


def test_readme_python_examples_run_as_written() -> None:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    session: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), session)
