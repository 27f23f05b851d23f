"""The many-root collectives under mpirun, at any world size, on the MPI transport (concurrent
point-to-point sends, one Iallgather of lengths then concurrent Ibcasts) and on Gloo (one
all_to_all_single; one all_gather when every rank is a root): every root gets each rank's exact
payload, every rank each root's, counted as the sequential default (one gather / broadcast per
root) counts on the same transport; a rank missing from an MPI gather_many is named.
Every rank runs these tests in the same order (the single-process checks on the fake transport
are tests/unit/test_transport_many.py)."""
import re

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hvd_slim.transport import mpi_device
from hvd_slim.transport.base import Transport, TransportError, TransportTimeout
from hvd_slim.transport.mpi import MpiTransport

LARGE = 200_000   # past Open MPI's eager limits: the concurrent sends need the roots' progress


@pytest.fixture(params=["mpi", "gloo"])
def tr(request, hvd):
    """The tier's MPI transport, or the job's cached Gloo one (started on first use)."""
    if request.param == "mpi":
        return hvd.world_transport()
    from hvd_slim.optim.rendezvous import torch_transport
    return torch_transport("gloo", torch.device("cpu"))


def root_sets(n):
    # One root, two (the last first), every rank in a rotated order.
    return {"first": [0], "last_first": list(dict.fromkeys([n - 1, 0])),
            "all": [(r + 1) % n for r in range(n)]}


def payload(rank, root, large=False):
    """Rank- and root-dependent length and contents; rank 1's payload to root 0 is empty."""
    n = 0 if (rank, root) == (1, 0) else 5 * rank + 2 * root + 1 + (LARGE if large else 0)
    return ((np.arange(n) * (rank + 3) + 17 * root) % 253).astype(np.uint8)


def snap(t):
    s = t.stats
    return s.bytes_sent, s.bytes_received, s.calls, dict(s.per_op)


def since(t, before):
    s = t.stats
    per_op = {k: (v[0] - before[3].get(k, (0, 0))[0], v[1] - before[3].get(k, (0, 0))[1])
              for k, v in s.per_op.items()}
    return (s.bytes_sent - before[0], s.bytes_received - before[1], s.calls - before[2],
            {k: v for k, v in per_op.items() if v != (0, 0)})


def gather_counts(t, sizes, roots, bounds):
    """(sent, received) of one gather per root by base.py's rules; ``sizes[j][i]`` is rank j's
    payload length for ``roots[i]``. Gloo counts its padded frames (and the 8-byte agreement
    of an unbounded gather), as torch_dist.py says."""
    sent = received = 0
    for i, (root, bound) in enumerate(zip(roots, bounds)):
        lens = [row[i] for row in sizes]
        if t.name == "gloo":
            step, extra = (max(lens), 8) if bound is None else (bound, 0)
            sent += step + 8 + extra
            received += extra + (t.size * (step + 8) if t.rank == root else 0)
        else:
            sent += lens[t.rank] + 8
            received += sum(lens) + 8 * t.size if t.rank == root else 0
    return sent, received


def broadcast_counts(t, lens, roots, bounds):
    """(sent, received) of one broadcast per root of ``lens[i]`` bytes by base.py's rules (Gloo:
    the padded frame when a bound is given)."""
    sent = received = 0
    for n, root, bound in zip(lens, roots, bounds):
        moved = (bound if t.name == "gloo" and bound is not None else n) + 8
        sent += moved if t.rank == root else 0
        received += moved
    return sent, received


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("which", ["first", "last_first", "all"])
def test_gather_many_delivers_every_payload_counted_as_the_gathers(hvd, tr, which, large):
    n, r = hvd.size(), hvd.rank()
    roots = root_sets(n)[which]
    payloads = [payload(r, root, large) for root in roots]
    # A bound for some roots (loose), none for others (Gloo agrees on one first).
    bounds = [None if i % 2 else max(len(payload(j, root, large)) for j in range(n)) + i
              for i, root in enumerate(roots)]
    before = snap(tr)
    got = tr.gather_many(payloads, roots, bounds)
    many = since(tr, before)
    before = snap(tr)
    want = Transport.gather_many(tr, payloads, roots, bounds)   # the sequential default
    assert many == since(tr, before)
    sizes = [[len(payload(j, root, large)) for root in roots] for j in range(n)]
    assert many[:3] == gather_counts(tr, sizes, roots, bounds) + (len(roots),)
    if r in roots:
        expect = [payload(j, r, large).tolist() for j in range(n)]
        assert [g.tolist() for g in got] == expect == [w.tolist() for w in want]
    else:
        assert got is None and want is None


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("which", ["first", "last_first", "all"])
def test_broadcast_many_delivers_every_roots_payload(hvd, tr, which, large):
    n, r = hvd.size(), hvd.rank()
    roots = root_sets(n)[which]
    empty = roots[-1] if len(roots) > 1 else None   # one of several roots broadcasts nothing
    lens = {root: 0 if root == empty else len(payload(root, root, large)) for root in roots}
    mine = payload(r, r, large)[:lens[r]] if r in roots else None
    for bounds in ([None] * len(roots), [lens[root] + 3 for root in roots]):
        before = snap(tr)
        got = tr.broadcast_many(mine, roots, bounds)
        many = since(tr, before)
        before = snap(tr)
        want = Transport.broadcast_many(tr, mine, roots, bounds)
        single = since(tr, before)
        expect = [[] if lens[root] == 0 else payload(root, root, large).tolist()
                  for root in roots]
        assert [g.tolist() for g in got] == expect == [w.tolist() for w in want]
        if tr.name == "gloo" and len(roots) == n and None not in bounds:
            # One all_gather of frames padded to the largest bound: what really moves.
            step = max(bounds) + 8
            assert many == (step, n * step, n, {"broadcast": (step, n * step)})
        else:
            assert many == single
            assert many[:3] == broadcast_counts(tr, [lens[root] for root in roots], roots,
                                                bounds) + (len(roots),)


@pytest.mark.parametrize("staged", [False, True])
def test_the_tensor_twins_equal_the_numpy_collectives(hvd, tr, monkeypatch, staged):
    if staged:
        if tr.name != "mpi":
            pytest.skip("staging through host buffers is the MPI transport's path")
        monkeypatch.setattr(mpi_device, "_direct", lambda device: False)
    n, r = hvd.size(), hvd.rank()
    for roots in root_sets(n).values():
        payloads = [payload(r, root) for root in roots]
        bounds = [len(payload(n - 1, root)) + 4 * n for root in roots]
        before = snap(tr)
        got = tr.gather_many_tensor([torch.from_numpy(p.copy()) for p in payloads], roots,
                                    bounds)
        counts = since(tr, before)
        before = snap(tr)
        want = tr.gather_many(payloads, roots, bounds)
        assert since(tr, before) == counts
        assert (got is None) == (want is None) == (r not in roots)
        if got is not None:
            assert all(isinstance(g, torch.Tensor) for g in got)
            assert [g.tolist() for g in got] == [w.tolist() for w in want]
        mine = payload(r, r) if r in roots else None
        before = snap(tr)
        got = tr.broadcast_many_tensor(None if mine is None else torch.from_numpy(mine.copy()),
                                       roots, bounds, device="cpu")
        counts = since(tr, before)
        before = snap(tr)
        want = tr.broadcast_many(mine, roots, bounds)
        assert since(tr, before) == counts
        assert [g.tolist() for g in got] == [w.tolist() for w in want] == \
            [payload(root, root).tolist() for root in roots]


def test_a_rank_missing_from_an_mpi_gather_many_is_named(hvd):
    """On a private communicator (a timeout retires the transport): the last rank never calls
    gather_many; every root times out naming it as the rank that sent nothing, the other ranks
    (at 4 ranks and more) complete."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    comm, late = MPI.COMM_WORLD.Dup(), n - 1
    t = MpiTransport(comm)
    roots = [0] if n == 2 else [1, 0]
    payloads = [np.full(3 + r, r, np.uint8) for _ in roots]
    if r not in roots and r != late:   # its small sends complete without the late rank
        with t.watch(1.0, "the probe"):
            assert t.gather_many(payloads, roots, [None] * len(roots)) is None
    elif r != late:
        with t.watch(1.0, "the probe"):
            with pytest.raises(TransportTimeout) as info:
                t.gather_many(payloads, roots, [None] * len(roots))
        msg = str(info.value)
        label = "gather to rank 0" if n == 2 else "gather to ranks 1, 0"
        assert re.fullmatch(rf"rank {r}: {label} in the probe timed out after 1 s: rank\(s\) "
                            rf"{late} sent nothing", msg), msg
        with pytest.raises(TransportError, match="unusable after an earlier failure"):
            t.broadcast_many(np.zeros(1, np.uint8) if r in roots else None, roots,
                             [None] * len(roots))
    hvd.barrier()
    comm.Free()   # nothing of the late rank was ever received or posted: no request is left
