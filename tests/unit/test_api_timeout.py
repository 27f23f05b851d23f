"""The tensor API's timeout (api/timeout.py) in one process, without MPI: where the
limit comes from, and what a timed-out call says and arranges. The real collectives time out
in the MPI tier (tests/distributed/test_api.py, tests/scripts/skip_collective.py)."""
import types
from contextlib import contextmanager

import pytest

from hvd_slim.config import DEFAULT_TIMEOUT, ConfigError
from hvd_slim.runtime import abort
from hvd_slim.api import timeout as api_timeout
from hvd_slim.transport.base import TransportTimeout


@pytest.mark.parametrize("raw,seconds", [(None, DEFAULT_TIMEOUT), ("3", 3.0), ("2.5", 2.5),
                                         ("0", None), ("none", None), ("off", None)])
def test_the_limit_is_hvd_slim_timeout_or_the_exchanges_default(raw, seconds):
    environ = {} if raw is None else {"HVD_SLIM_TIMEOUT": raw}
    assert api_timeout.api_timeout(environ) == seconds


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan"])
def test_a_bad_value_names_the_variable(raw):
    with pytest.raises(ConfigError, match="HVD_SLIM_TIMEOUT"):
        api_timeout.api_timeout({"HVD_SLIM_TIMEOUT": raw})


@pytest.fixture
def fake_mpi_api(monkeypatch):
    """Stands in for the job's collectives (transport.mpi_api.MpiCollectives), handed to each
    operation as the runtime's would be: records each watch."""
    seen = []

    @contextmanager
    def watch(seconds, label):
        seen.append((seconds, label))
        yield

    stub = types.SimpleNamespace(watch=watch, seen=seen)
    stub.given = lambda: stub
    ended = []
    monkeypatch.setattr(abort, "end_job_at_exit", ended.append)
    stub.ended = ended
    return stub


def test_a_timeout_names_the_call_and_how_to_wait_longer(fake_mpi_api, monkeypatch):
    monkeypatch.setenv("HVD_SLIM_TIMEOUT", "3")
    inner = "rank 0: allreduce of 'x' timed out after 3 s in MPI Iallreduce: rank(s) 2 did not arrive"
    with pytest.raises(TransportTimeout) as info:
        with api_timeout.operation("broadcast_optimizer_state", fake_mpi_api.given):
            with api_timeout.operation("allreduce of 'x'", fake_mpi_api.given):
                raise TransportTimeout(inner)
    msg = str(info.value)
    assert msg.startswith(inner + ". A rank died or hangs"), msg
    assert msg.count("raise HVD_SLIM_TIMEOUT") == 1 and msg.endswith("(now 3 s)"), msg
    # A nested call is labelled with the outermost one; the limit is read from the environment.
    assert fake_mpi_api.seen == [(3.0, "broadcast_optimizer_state"),
                                 (3.0, "allreduce of 'x', in broadcast_optimizer_state")]
    # The communicator is beyond repair: should the process reach exit, the job is ended.
    assert fake_mpi_api.ended == [inner]


def test_labels_do_not_repeat_the_outer_call(fake_mpi_api):
    with api_timeout.operation("broadcast_parameters", fake_mpi_api.given):
        with api_timeout.operation("broadcast_parameters of 'w'", fake_mpi_api.given):
            pass
    assert [label for _, label in fake_mpi_api.seen] == ["broadcast_parameters",
                                                         "broadcast_parameters of 'w'"]


def test_other_errors_pass_through_untouched(fake_mpi_api):
    with pytest.raises(ValueError, match="^mismatch$"):
        with api_timeout.operation("allgather", fake_mpi_api.given):
            raise ValueError("mismatch")
    assert fake_mpi_api.ended == []
