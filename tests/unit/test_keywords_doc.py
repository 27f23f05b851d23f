"""docs/keywords.md documents every Slim-DP keyword DistributedOptimizer accepts."""
import os
import re

from hvd_slim.optim.wrapping import SLIM_KEYWORDS

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "keywords.md")


def test_every_keyword_has_a_row_in_the_keyword_reference():
    with open(DOC, encoding="utf-8") as f:
        rows = set(re.findall(r"^\| `(\w+)`", f.read(), flags=re.M))
    missing = sorted(set(SLIM_KEYWORDS) - rows)
    assert not missing, f"docs/keywords.md has no row for {missing}"
