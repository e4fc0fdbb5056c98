"""The seconds each test file took in a full run, which ``conftest.py`` orders the files by:
longest first, so that pytest-xdist (``--dist loadfile --no-loadscope-reorder``, as ``make test``
runs it) hands the long files out first and the two processes end together, instead of one
running a long file alone at the end (xdist's own order is by the number of tests in a file).

Regenerate from a full run's log (``make test PYTEST_ARGS=--durations=0 > run.log``)::

    python tests/_file_seconds.py run.log

writes ``tests/file_seconds.json`` (setup, call and teardown summed per file)."""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

FILE = Path(__file__).with_name("file_seconds.json")
LINE = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+tests/([^:]+\.py)::")


def load() -> dict[str, float]:
    """{file name: seconds}, {} when the file is missing or unreadable."""
    try:
        return json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}


def from_log(text: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if m := LINE.match(line.strip()):
            seconds[m.group(2)] += float(m.group(1))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    found = from_log(Path(sys.argv[1]).read_text())
    if not found:
        sys.exit(f"no --durations lines in {sys.argv[1]}: run pytest with --durations=0")
    FILE.write_text(json.dumps(found, indent=0) + "\n")
    print(f"{len(found)} files, {sum(found.values()) / 60:.1f} min in all -> {FILE}")
