"""benchmarks/synthetic.py's pure parts: the import swap and the img/s summary (the cluster runs
themselves need root and take minutes: ``python -m benchmarks.synthetic``)."""
import ast

import pytest

from benchmarks import synthetic


def test_the_horovod_copy_differs_from_the_example_by_the_import_line_alone(tmp_path):
    path = synthetic.horovod_copy(str(tmp_path))
    mine = open(synthetic.EXAMPLE, encoding="utf-8").read().splitlines()
    theirs = open(path, encoding="utf-8").read().splitlines()
    changed = [(a, b) for a, b in zip(mine, theirs) if a != b]
    assert len(mine) == len(theirs) and changed == [(synthetic.SLIM_IMPORT,
                                                     synthetic.HOROVOD_IMPORT)]
    imports = [n for n in ast.walk(ast.parse("\n".join(theirs))) if isinstance(n, ast.Import)]
    assert any(a.name == "horovod.torch" and a.asname == "hvd" for n in imports for a in n.names)


def test_the_summary_totals_each_repeat_over_the_ranks_and_compares_with_horovod():
    runs = {"horovod": [{"mean": 3.0}, {"mean": 2.0}], "hvd_slim": [{"mean": 3.5}, {"mean": 3.0}]}
    s = synthetic.summarise(runs, 4)
    assert s["horovod"]["img_sec_total"] == pytest.approx(10.0)
    assert (s["hvd_slim"]["min"], s["hvd_slim"]["max"]) == (12.0, 14.0)
    assert s["hvd_slim"]["vs_horovod"] == pytest.approx(1.3)
    assert "| hvd_slim | 2 | 13.0 | 12.0-14.0 | 1.30x |" in synthetic.table(s)


def test_without_horovod_the_ratio_is_not_made_up():
    s = synthetic.summarise({"hvd_slim": [{"mean": 3.0}]}, 2)
    assert s["hvd_slim"]["vs_horovod"] != s["hvd_slim"]["vs_horovod"]   # NaN
    assert [name for name, _ in synthetic.runtimes("/nonexistent", horovod=False)] == ["hvd_slim"]
