"""docs/architecture.md and docs/design.md name files and functions: each file must exist, and
each name that follows a file in a row must occur in that file, so the map cannot drift from
the code unnoticed."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("benchmarks/", "tests/", "examples/", "scripts/", "docs/")


def _rows(doc: str):
    for line in (ROOT / doc).read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and "`" in line:
            yield line


def _resolve(path: str) -> Path:
    return ROOT / path if path.startswith(OUTSIDE) else ROOT / "hvd_slim" / path


def _named(doc: str):
    """(file, name) pairs: every backticked identifier after a backticked .py path in a row."""
    out = []
    for row in _rows(doc):
        where = row.split("|")[-2]   # the last cell says where
        current, folder = None, ""
        for token in re.findall(r"`([^`]+)`", where):
            if token.endswith("/"):   # "`elastic/`: `state.py`, ..." names files in a folder
                folder = token
            elif token.endswith(".py"):
                # a bare name lives in the folder named, beside the file before it, or at the
                # package's top
                beside = current.rsplit("/", 1)[0] + "/" if current and "/" in current else ""
                tries = [token] if "/" in token else [folder + token, beside + token, token]
                current = next((t for t in tries if _resolve(t).exists()), tries[0])
                out.append((current, None))
            elif current and re.fullmatch(r"[A-Za-z_][\w.]*", token):
                head = token.split(".")[0]
                if "." in token and _resolve(head + ".py").exists():
                    out.append((head + ".py", token))   # module.function
                else:
                    out.append((current, token))
    return out


CASES = sorted(set(_named("docs/architecture.md")), key=lambda c: (c[0], c[1] or ""))


def test_the_map_names_something():
    assert len(CASES) > 100


@pytest.mark.parametrize("path, name", CASES, ids=lambda x: str(x))
def test_every_named_file_and_name_exists(path, name):
    f = _resolve(path)
    assert f.exists(), f"docs/architecture.md names {path}, which does not exist"
    if name is None:
        return
    text = f.read_text(encoding="utf-8")
    last = name.split(".")[-1]
    assert re.search(rf"\b{re.escape(last)}\b", text), \
        f"docs/architecture.md names {name} in {path}, which has no {last!r}"


def test_design_names_what_the_code_has():
    text = (ROOT / "docs/design.md").read_text(encoding="utf-8")
    for name in re.findall(r"`(\w+)\.(\w+)`", text):
        cls, attr = name
        if cls[0].isupper():
            hits = [p for p in (ROOT / "hvd_slim").rglob("*.py")
                    if re.search(rf"class {cls}\b", p.read_text(encoding="utf-8"))]
            if hits:
                assert any(re.search(rf"\b{attr}\b", p.read_text(encoding="utf-8"))
                           for p in hits), f"docs/design.md names {cls}.{attr}"
