"""The Horovod-suite harness (benchmarks/horovod_suite) on synthetic inputs: which tests it
finds in a suite file, how it reads each rank's JUnit report, and that its shim's
``horovod.torch`` is hvd_slim's namespace and nothing else."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.horovod_suite.__main__ import SHIM, _rank_outcome, suite_tests

pytestmark = pytest.mark.bench


def test_suite_tests_are_the_testcase_methods(tmp_path):
    suite = tmp_path / "test_x.py"
    suite.write_text("import unittest\nclass T(unittest.TestCase):\n    def test_a(self): pass\n"
                     "    def helper(self): pass\n    def test_b(self): pass\n"
                     "def test_free(): pass\n")
    assert suite_tests(str(suite)) == [f"{suite}::T::test_a", f"{suite}::T::test_b"]


@pytest.mark.parametrize("body, outcome, why", [
    ("", "passed", ""),
    ('<skipped message="No GPUs available"/>', "skipped", "No GPUs available"),
    ('<failure message="AssertionError: bad sum">trace</failure>', "failed", "AssertionError: bad sum"),
    ('<error message="">boom\nmore</error>', "failed", "boom"),
])
def test_a_rank_report_is_read(tmp_path, body, outcome, why):
    xml = tmp_path / "rank0.xml"
    xml.write_text(f'<testsuites><testsuite><testcase name="t">{body}</testcase></testsuite>'
                   f'</testsuites>')
    assert _rank_outcome(str(xml)) == (outcome, why)
    assert _rank_outcome(str(tmp_path / "missing.xml"))[0] == "failed"


def test_the_shim_re_exports_hvd_slim_only():
    code = ("import hvd_slim, horovod.torch as h, horovod.runner.util.threads as t, mock\n"
            "public = {k for k in dir(h) if not k.startswith('_')}\n"
            "assert set(hvd_slim.__all__) <= public <= set(dir(hvd_slim)), public\n"
            "assert all(getattr(h, k) is getattr(hvd_slim, k) for k in public)\n"
            "th = t.in_thread(lambda: None); th.join(); print('ok')")
    env_path = SHIM
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": env_path + ":" + ":".join(sys.path)}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_subset_run_updates_only_its_tests(tmp_path, monkeypatch):
    import json

    from benchmarks.horovod_suite import __main__ as suite
    monkeypatch.setattr(suite, "RESULTS", str(tmp_path))
    first = {"test_a": {"outcome": "failed", "why": "x", "seconds": 1.0},
             "test_b": {"outcome": "passed", "why": "", "seconds": 1.0}}
    assert suite.write_report(2, first, "s.py").startswith("np=2: 1 passed, 1 failed")
    again = {"test_a": {"outcome": "passed", "why": "", "seconds": 1.0}}
    assert suite.write_report(2, again, "s.py", merge=True).startswith("np=2: 2 passed, 0 failed")
    assert set(json.load(open(tmp_path / "np2.json"))["tests"]) == {"test_a", "test_b"}
    assert suite.write_report(2, again, "s.py").startswith("np=2: 1 passed, 0 failed")
