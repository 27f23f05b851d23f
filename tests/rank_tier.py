"""What the tiers that run one pytest process per rank (tests/distributed under mpirun,
tests/torchrun under torchrun) share, in their conftests and their launchers; they differ only
in how they learn their rank, how they end the job and how their summary line starts.

* :class:`OutsideTheJob`: outside the tier's job the tier's test modules are not even imported
  (each is reported skipped, so a plain ``pytest tests/`` never runs them in one process), and
  inside it the tier's launcher is not collected (it would start the tier again).
* :class:`RankHooks`, on each rank of the job: starts hvd_slim (``hvd_slim.init()``) when the
  session starts; on a failed or erroring test or collection prints ``rank R: FAILED <nodeid>``
  with the report and ends the whole job, since the other ranks would otherwise wait in the
  failed test's next collective until they time out; counts the passed, failed and skipped
  tests and prints, at the end, ``<prefix>: rank R of N passed=P failed=F skipped=S
  exitstatus=E``, the line the tier's launcher parses.

A tier's conftest binds :class:`OutsideTheJob`'s methods to pytest's hook names (so that
pytest calls them for its own folder only) and registers a :class:`RankHooks` as a plugin in
``pytest_configure``. :func:`api_namespace` makes its ``hvd`` fixture, and the tier's
launcher checks the ranks' summary lines with :func:`tier_problem` and a job of
tests/scripts/skip_collective.py with :func:`check_skipped_collective`.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import pytest


class SkippedModule(pytest.Module):
    """Stands in for a tier's test module outside the tier's job: reported skipped (with
    ``skip_reason``, set by :class:`OutsideTheJob`), never imported."""

    skip_reason = "needs one process per rank"

    def collect(self) -> Any:
        pytest.skip(self.skip_reason)


class OutsideTheJob:
    """The collection hooks of a tier whose modules run only on the ranks of its job.

    Args:
        active: this process is one rank of the tier's job.
        here: the tier's folder; every module below it but the launcher is the tier's.
        launcher: the file name of the tier's launcher, which runs outside the job only.
        reason: why a module is skipped outside the job (how to run the tier).
    """

    def __init__(self, active: bool, here: Path, launcher: str, reason: str) -> None:
        self.active, self.here, self.launcher, self.reason = active, here, launcher, reason

    def pycollect_makemodule(self, module_path: Path, parent: Any) -> Any:
        """``pytest_pycollect_makemodule``: outside the job, a skipped stand-in for each of the
        tier's modules; None (pytest's own module) otherwise."""
        path = Path(module_path)
        if not self.active and self.here in path.resolve().parents and path.name != self.launcher:
            module = SkippedModule.from_parent(parent, path=path)
            module.skip_reason = self.reason
            return module
        return None

    def ignore_collect(self, collection_path: Path, config: Any) -> Any:
        """``pytest_ignore_collect``: inside the job the launcher would start the tier again
        from inside it, so it is not collected there."""
        return True if self.active and collection_path.name == self.launcher else None


class RankHooks:
    """The hooks of one rank of a tier's job, a pytest plugin (every hook does nothing
    outside the job).

    Args:
        active: this process is one rank of the tier's job.
        rank: this process's rank (None where unknown: the reports then say ``rank ?``).
        size: the number of ranks in the job.
        end_job: prints the report of a failure (a complete message) and ends every rank of
            the job; does not return.
        ending: what ``end_job`` does, for the report's last line (e.g. ``aborting the MPI
            job``).
        prefix: how the summary line starts (e.g. ``hvd_slim-tier``), as the launcher expects.
    """

    def __init__(self, active: bool, rank: Optional[Union[int, str]],
                 size: Optional[Union[int, str]], end_job: Callable[[str], None], ending: str,
                 prefix: str) -> None:
        self.active = active
        self.rank, self.size = rank, size
        self.end_job, self.ending, self.prefix = end_job, ending, prefix
        self.counts: Dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}

    def tag(self) -> str:
        """``rank R`` (``rank ?`` where the rank is unknown), as the reports name this rank."""
        return f"rank {'?' if self.rank is None else self.rank}"

    def fail(self, nodeid: str, text: str) -> None:
        """Report the failure of ``nodeid`` (its report ``text``) and end every rank of the job."""
        self.end_job(f"\n{self.tag()}: FAILED {nodeid}\n{text}\n{self.tag()}: {self.ending}")

    def pytest_sessionstart(self, session: Any) -> None:
        """``pytest_sessionstart``: start hvd_slim, as every test of the tier expects."""
        if self.active:
            import hvd_slim
            hvd_slim.init()

    def pytest_collectreport(self, report: Any) -> None:
        """``pytest_collectreport``: a module that fails to collect on one rank ends the job."""
        if self.active and report.failed:
            self.fail(report.nodeid or "<collection>", str(report.longrepr))

    def pytest_runtest_logreport(self, report: Any) -> None:
        """``pytest_runtest_logreport``: count the outcome; a failure ends the job."""
        if not self.active:
            return
        if report.failed:
            self.counts["failed"] += 1
            self.fail(report.nodeid, report.longreprtext)
        elif report.when == "call" and report.passed:
            self.counts["passed"] += 1
        elif report.skipped:
            self.counts["skipped"] += 1

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        """``pytest_sessionfinish``: print this rank's summary line for the launcher."""
        if self.active:
            sys.stdout.write(f"\n{self.prefix}: rank {self.rank} of {self.size} "
                             f"passed={self.counts['passed']} failed={self.counts['failed']} "
                             f"skipped={self.counts['skipped']} exitstatus={int(exitstatus)}\n")
            sys.stdout.flush()


def api_namespace(*modules: Any) -> types.SimpleNamespace:
    """The public names of ``modules`` in one namespace, a later module's winning: the API as
    a Horovod script sees it (``import hvd_slim as hvd``), for a tier's ``hvd`` fixture."""
    ns = types.SimpleNamespace()
    for module in modules:
        for key in dir(module):
            if not key.startswith("_"):
                setattr(ns, key, getattr(module, key))
    return ns


def tier_problem(prefix: str, np_: int, rc: int, out: str, launcher: str) -> Optional[str]:
    """What went wrong in a tier's run on ``np_`` ranks (``launcher`` exited with ``rc``,
    printing ``out``), from the summary lines that start with ``prefix``; None when it exited 0
    and every rank reported the same nonzero number of passed tests and no failure."""
    summaries: Dict[int, Tuple[int, int, int]] = {
        int(m.group(1)): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
        for m in re.finditer(rf"{re.escape(prefix)}: rank (\d+) of {np_} passed=(\d+) "
                             rf"failed=(\d+) skipped=\d+ exitstatus=(\d+)", out)}
    if rc != 0:
        return f"{launcher} exited with {rc}"
    if sorted(summaries) != list(range(np_)):
        return f"ranks {sorted(set(range(np_)) - set(summaries))} did not report a summary"
    if any(failed or status for _, failed, status in summaries.values()):
        return f"a rank reported failures: {summaries}"
    if len({passed for passed, _, _ in summaries.values()}) != 1 or summaries[0][0] == 0:
        return f"the ranks passed different (or zero) numbers of tests: {summaries}"
    return None


def check_skipped_collective(out: str, np_: int, label: str, timeout: int, catch: bool,
                             waits_in: str, context: str) -> None:
    """Assert that in the output ``out`` of tests/scripts/skip_collective.py on ``np_`` ranks,
    whose last rank skipped the call ``label``, every other rank caught a TransportTimeout
    after ``timeout`` s that names the call, where it waited (the regex ``waits_in``, e.g.
    ``MPI I\\w+ \\(collective #\\d+ on this communicator\\)``), the missing rank and how to
    wait longer; and that the job ended: at exit after a caught timeout (``catch``), else from
    the uncaught one. ``context`` ends each failure's message."""
    skipper = np_ - 1
    for r in range(skipper):
        line = re.search(rf"skip_collective: rank {r} caught: (.*)", out)
        assert line, f"rank {r} did not time out: {context}"
        m = re.match(rf"rank {r}: {re.escape(label)} timed out after {timeout} s in {waits_in}: "
                     r"rank\(s\) ([\d, ]+) did not arrive\. A rank died or hangs", line.group(1))
        assert m and m.group(1) == str(skipper), f"rank {r}: {line.group(1)!r}; {context}"
        assert line.group(1).endswith(f"raise HVD_SLIM_TIMEOUT (seconds; 0 waits forever) "
                                      f"(now {timeout} s)"), line.group(1)
    ending = (r"reached exit after a collective timed out" if catch
              else rf"hvd_slim: rank \d of {np_} failed with TransportTimeout")
    assert re.search(ending, out), context
    assert "unreachable" not in out, context
