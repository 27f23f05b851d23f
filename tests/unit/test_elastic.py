"""hvd_slim.elastic in one process: State/ObjectState/TorchState commit, restore and sync (a
restore is bitwise, the DistributedOptimizer's exchange state included, on a fake 2-rank
cluster), ElasticSampler against Horovod's documented behaviour, and run()'s retry loop with
injected failures. The real failures under mpirun: test_elastic_launch.py."""
import inspect
import math
import random

import pytest
import torch

import hvd_slim as hvd
from hvd_slim import elastic
from hvd_slim.elastic import (ElasticSampler, HorovodInternalError, HostsUpdatedInterrupt,
                              ObjectState, State, TorchState)
from hvd_slim.elastic.runner import run_fn
from hvd_slim.transport import run_ranks
from hvd_slim.transport.base import TransportTimeout

from test_api_docstrings import _check_args, _parameters, _section
from test_reliability_checkpoint import train, wrap
from test_reliability_nonfinite import model


def tensors(sd):
    """Every tensor in a nested state dict, in a fixed order."""
    if torch.is_tensor(sd):
        return [sd]
    if isinstance(sd, dict):
        return [t for k in sorted(sd, key=str) for t in tensors(sd[k])]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors(v)]
    return []


def same(a, b):
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y)
                                      for x, y in zip(ta, tb))


# ---- State / ObjectState ------------------------------------------------------------------------

def test_object_state_commit_restore_are_deep_copies():
    s = ObjectState(bcast_object=lambda o: o, get_rank=lambda: 0, epoch=0, seen=[1])
    s.epoch, s.seen = 3, s.seen + [2]
    s.commit()
    s.epoch = 9
    s.seen.append(99)            # in place: must not reach the commit
    s.restore()
    assert (s.epoch, s.seen) == (3, [1, 2])
    s.seen.append(7)
    s.restore()
    assert s.seen == [1, 2]


def test_object_state_sync_takes_rank_zeros_commit():
    root = {"epoch": 5, "batch": 2}
    s = ObjectState(bcast_object=lambda o: dict(root), get_rank=lambda: 1, epoch=0, batch=0)
    s.sync()
    assert (s.epoch, s.batch) == (5, 2)
    s.epoch = 6
    s.restore()                  # the synced values are the commit now
    assert s.epoch == 5


def test_check_host_updates_is_a_no_op_and_commit_calls_save():
    calls = []

    class Counting(State):
        def save(self):
            calls.append("save")

    s = Counting(bcast_object=lambda o: pytest.fail("no collective"), get_rank=lambda: 0)
    s.commit()
    s.check_host_updates()
    assert calls == ["save"]


# ---- TorchState -----------------------------------------------------------------------------------

def test_torch_state_restore_is_bitwise_with_the_exchange_state():
    """2 fake ranks: commit after 3 steps, take 2 more (the run that fails), restore, take the 2
    again: parameters, inner state and exchange state (residuals, server) equal a run that
    never failed, bit for bit."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr)
        state = TorchState(m, opt, epoch=0)
        train(m, opt, rank, range(3))
        state.epoch = 3
        state.commit()
        committed = {k: v.clone() for k, v in m.state_dict().items()}
        train(m, opt, rank, range(3, 5))
        state.epoch = 5
        assert not same(m.state_dict(), committed)
        state.restore()
        assert same(m.state_dict(), committed) and state.epoch == 3
        assert same(opt.state_dict(), state._handlers["optimizer"].saved)
        train(m, opt, rank, range(3, 5))
        return m.state_dict(), opt.state_dict()

    def uninterrupted(rank, tr):
        m = model()
        opt = wrap(m, tr)
        train(m, opt, rank, range(5))
        return m.state_dict(), opt.state_dict()

    for (m1, o1), (m2, o2) in zip(run_ranks(2, body, timeout=60),
                                  run_ranks(2, uninterrupted, timeout=60)):
        assert same(m1, m2)
        assert o1["hvd_slim"]["server"] is not None or o1["hvd_slim"]["rank"] != 0
        assert same(o1, o2)   # inner momentum and the whole exchange state


def test_torch_state_tracks_reassigned_models_and_plain_attributes():
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(10), world=lambda: (0, 1))
    state = TorchState(m1, opt, sampler=sampler, batch=0)
    assert set(state._handlers) == {"model", "optimizer", "sampler"}
    state.model = m2                     # a new model is tracked and committed at once
    before = m2.weight.detach().clone()
    with torch.no_grad():
        m2.weight.add_(1.0)
    sampler.record_batch(0, 5)
    state.batch = 1
    state.restore()
    assert torch.equal(m2.weight, before) and state.batch == 0 and sampler.processed_num == 0


def test_torch_state_sync_broadcasts_model_optimizer_sampler_and_attributes(monkeypatch):
    import hvd_slim.api.functions as functions
    seen = []
    monkeypatch.setattr(functions, "broadcast_parameters",
                        lambda params, root_rank: seen.append(("params", root_rank)))
    monkeypatch.setattr(functions, "broadcast_optimizer_state",
                        lambda opt, root_rank: seen.append(("optimizer", root_rank)))
    monkeypatch.setattr(functions, "broadcast_object",
                        lambda obj, root_rank=0, name=None: seen.append(("object", root_rank)) or obj)
    m = torch.nn.Linear(2, 2)
    state = TorchState(m, torch.optim.SGD(m.parameters(), lr=0.1),
                       sampler=ElasticSampler(range(4), world=lambda: (0, 1)), epoch=1)
    state.sync()
    # Handlers in keyword order (model and optimizer last, as Horovod), then the attributes.
    assert [k for k, _ in seen] == ["object", "params", "optimizer", "object"]
    assert all(root == 0 for _, root in seen) and state.epoch == 1


# ---- ElasticSampler -------------------------------------------------------------------------------

def horovod_indices(n, rank, size, seed, epoch, processed, shuffle=True):
    """Horovod 0.28.1's ElasticSampler, written out from its documentation and source."""
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    rest = order[processed:]
    per = int(math.ceil(len(rest) / size))
    rest += rest[:per * size - len(rest)]
    return rest[rank:per * size:size]


@pytest.mark.parametrize("n,size", [(10, 3), (12, 4), (7, 1), (5, 8)])
def test_sampler_indices_per_rank_match_horovod(n, size):
    parts = [list(ElasticSampler(range(n), seed=4, world=lambda r=r: (r, size)))
             for r in range(size)]
    for r, part in enumerate(parts):
        assert part == horovod_indices(n, r, size, 4, 0, 0)
        assert len(part) == math.ceil(n / size)
    assert set().union(*map(set, parts)) == set(range(n))   # every index, padding by repeats


def test_sampler_resumes_after_record_batch_on_fewer_ranks():
    world = [0, 3]
    s = ElasticSampler(range(30), seed=1, world=lambda: tuple(world))
    s.set_epoch(2)
    s.record_batch(0, 4)
    s.record_batch(1, 4)          # 2 batches of 4 on 3 ranks: 24 done
    saved = s.state_dict()
    assert saved["processed_num"] == 24 and saved["epoch"] == 2
    world[:] = [1, 2]              # a rank was lost; this one is now rank 1 of 2
    t = ElasticSampler(range(30), seed=1, world=lambda: tuple(world))
    t.load_state_dict(saved)
    assert list(t) == horovod_indices(30, 1, 2, 1, 2, 24) and len(t) == 3
    t.set_epoch(3)                 # a new epoch starts from nothing processed
    assert t.processed_num == 0 and len(t) == 15


def test_sampler_record_indices_and_horovods_state_dict():
    s = ElasticSampler(range(6), shuffle=False, world=lambda: (0, 1))
    s.record_indices([0, 3])
    s.reset()
    assert list(s) == [1, 2, 4, 5]
    s.load_state_dict({"epoch": 0, "processed_num": 4})    # Horovod's keys only
    assert list(s) == [4, 5] and s.processed_indices == set()


# ---- run() ------------------------------------------------------------------------------------

class Recorder(State):
    def __init__(self, log):
        super().__init__(bcast_object=lambda o: o, get_rank=lambda: 0)
        self.log = log
        self.register_reset_callbacks([lambda: log.append("callback")])

    def save(self):
        self.log.append("save")

    def restore(self):
        self.log.append("restore")

    def sync(self):
        self.log.append("sync")

    def reset(self):
        self.log.append("reset-state")


def failing(log, errors):
    def func(state, x):
        log.append("func")
        if errors:
            raise errors.pop(0)
        return x * 2
    return func


@pytest.mark.parametrize("error", [HorovodInternalError("injected"),
                                   TransportTimeout("rank 1: a collective timed out")])
def test_run_restores_resets_and_retries_after_a_communication_failure(error):
    log = []
    wrapped = run_fn(failing(log, [error]), reset=lambda: log.append("reset"))
    assert wrapped(Recorder(log), 21) == 42
    assert log == ["sync", "func", "restore", "reset", "reset-state", "callback", "sync", "func"]


def test_run_on_hosts_updated_syncs_without_restore_or_reset():
    log = []
    wrapped = run_fn(failing(log, [HostsUpdatedInterrupt(False), HostsUpdatedInterrupt(True)]),
                     reset=lambda: log.append("reset"))
    assert wrapped(Recorder(log), 1) == 2
    assert log == ["sync", "func", "reset-state", "callback", "sync", "func",
                   "reset-state", "callback", "func"]   # skip_sync=True: no sync before retry


def test_run_lets_other_exceptions_through_without_restoring():
    log = []
    wrapped = run_fn(failing(log, [ValueError("a bug")]), reset=lambda: log.append("reset"))
    with pytest.raises(ValueError, match="a bug"):
        wrapped(Recorder(log), 1)
    assert log == ["sync", "func"]


def test_exceptions_are_horovods_shape():
    assert issubclass(HorovodInternalError, RuntimeError)
    assert HostsUpdatedInterrupt(True).skip_sync is True
    assert hvd.elastic is elastic and hvd.elastic.run is elastic.run


# ---- docstrings ---------------------------------------------------------------------------------

PUBLIC = [(f"{name}.{key}", fn) for name in ("State", "ObjectState", "TorchState", "ElasticSampler")
          for key, fn in vars(getattr(elastic, name)).items()
          if inspect.isfunction(fn) and not key.startswith("_")] + [("run", elastic.run)]


@pytest.mark.parametrize("name,fn", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_elastic_docstrings_have_args_and_returns(name, fn):
    doc = inspect.getdoc(fn)
    assert doc and _section(doc, "Returns"), f"{name}: needs a 'Returns:' section"
    _check_args(name, doc, _parameters(fn) - {"self"})


@pytest.mark.parametrize("cls", [State, ObjectState, TorchState, ElasticSampler,
                                 HostsUpdatedInterrupt])
def test_elastic_class_docstrings_name_the_constructor_args(cls):
    _check_args(cls.__name__, inspect.getdoc(cls), _parameters(cls))


@pytest.mark.parametrize("ending, status", [("", 0), ("sys.exit(3)", 3), ("sys.exit(None)", 0),
                                            ("sys.exit('bye')", 1)])
def test_a_survivor_of_a_lost_rank_leaves_with_its_status_and_runs_later_exit_handlers(
        ending, status):
    # After a recovery that left ranks behind, MPI_Finalize could wait for them forever (seen
    # with Open MPI under --enable-recovery), so the process leaves with os._exit at exit: the
    # handlers registered after the recovery still run, the streams are flushed, and the
    # status is what sys.exit said; what was registered before (mpi4py's finalise among them)
    # is skipped. Run without MPI: the exit path itself is what is tested.
    import subprocess
    import sys
    code = ("import atexit, sys\n"
            "from hvd_slim.runtime import abort\n"
            "atexit.register(lambda: print('earlier handler ran'))\n"
            "abort.leave_without_finalize('rank 1 was left behind')\n"
            "atexit.register(lambda: print('later handler ran'))\n"
            "sys.stdout.write('unflushed output')\n" + ending + "\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert "unflushed output" in done.stdout and "later handler ran" in done.stdout
    assert "earlier handler ran" not in done.stdout   # it left by os._exit, as MPI's would be
