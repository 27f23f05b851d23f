"""The many-root collectives of :class:`~hvd_slim.transport.base.Transport` (``gather_many``,
``broadcast_many`` and their tensor twins) on the fake N-rank transport: the same payloads and
byte counts as one gather / broadcast per root, checked roots, enforced bounds. The MPI and Gloo
overrides run the same checks under mpirun: tests/distributed/test_transport_many.py."""
import numpy as np
import pytest
import torch

from hvd_slim.transport import run_ranks

pytestmark = pytest.mark.unit

SIZES = [2, 3, 5]


def root_sets(size):
    """One root, two in descending order, every rank (shuffled): the shapes sharding uses."""
    return [[0], [size - 1, 0], list(np.random.default_rng(size).permutation(size))]


def payload(rank, root, salt=0):
    """Rank- and root-dependent length and contents; rank 1's payload to root 0 is empty."""
    n = 0 if (rank, root) == (1, 0) else 3 * rank + root + salt + 1
    return ((np.arange(n) * (rank + 7) + 31 * root + salt) % 251).astype(np.uint8)


def delta(tr, before):
    """Counters since ``before`` (a snapshot of ``tr.stats``), per op included."""
    s = tr.stats
    return (s.bytes_sent - before[0], s.bytes_received - before[1], s.calls - before[2],
            {k: (v[0] - before[3].get(k, (0, 0))[0], v[1] - before[3].get(k, (0, 0))[1])
             for k, v in s.per_op.items()})


def snap(tr):
    return tr.stats.bytes_sent, tr.stats.bytes_received, tr.stats.calls, dict(tr.stats.per_op)


def bounds_for(roots, size):
    # A bound per root (some None), each at least every rank's payload to it.
    return [None if i % 2 else max(len(payload(r, root)) for r in range(size)) + i
            for i, root in enumerate(roots)]


@pytest.mark.parametrize("size", SIZES)
def test_gather_many_equals_one_gather_per_root(size):
    def body(rank, tr):
        out = []
        for roots in root_sets(size):
            roots = [int(r) for r in roots]
            bounds = bounds_for(roots, size)
            payloads = [payload(rank, root) for root in roots]
            before = snap(tr)
            got = tr.gather_many(payloads, roots, bounds)
            many = delta(tr, before)
            before = snap(tr)
            want = None
            for p, root, b in zip(payloads, roots, bounds):
                w = tr.gather(p, root, b)
                want = w if w is not None else want
            out.append((roots, got, want, many, delta(tr, before)))
        return out

    for rank, runs in enumerate(run_ranks(size, body, timeout=60)):
        for roots, got, want, many, single in runs:
            assert many == single
            if rank in roots:
                assert [g.tolist() for g in got] == [w.tolist() for w in want] == \
                    [payload(j, rank).tolist() for j in range(size)]
            else:
                assert got is None and want is None


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_many_equals_one_broadcast_per_root(size):
    def body(rank, tr):
        out = []
        for roots in root_sets(size):
            roots = [int(r) for r in roots]
            mine = payload(rank, rank, salt=5) if rank in roots else None
            bounds = [len(payload(r, r, salt=5)) + (i % 3) if i % 2 == 0 else None
                      for i, r in enumerate(roots)]
            before = snap(tr)
            got = tr.broadcast_many(mine, roots, bounds)
            many = delta(tr, before)
            before = snap(tr)
            want = [tr.broadcast(mine if rank == r else None, r, b) for r, b in zip(roots, bounds)]
            out.append((roots, got, want, many, delta(tr, before)))
        return out

    for runs in run_ranks(size, body, timeout=60):
        for roots, got, want, many, single in runs:
            assert many == single
            assert [g.tolist() for g in got] == [w.tolist() for w in want] == \
                [payload(r, r, salt=5).tolist() for r in roots]


@pytest.mark.parametrize("size", [2, 3])
def test_the_tensor_twins_equal_the_numpy_collectives(size):
    def body(rank, tr):
        roots = [size - 1, 0]
        payloads = [payload(rank, root) for root in roots]
        bounds = [None, None]
        before = snap(tr)
        got = tr.gather_many_tensor([torch.from_numpy(p.copy()) for p in payloads], roots,
                                    bounds)
        tensor_counts = delta(tr, before)
        before = snap(tr)
        want = tr.gather_many(payloads, roots, bounds)
        assert delta(tr, before) == tensor_counts
        if want is None:
            assert got is None
        else:
            assert [g.tolist() for g in got] == [w.tolist() for w in want]
        mine = payload(rank, rank, salt=2) if rank in roots else None
        b = tr.broadcast_many_tensor(None if mine is None else torch.from_numpy(mine.copy()),
                                     roots, bounds, device="cpu")
        assert all(isinstance(t, torch.Tensor) for t in b)
        return [t.tolist() for t in b]

    for got in run_ranks(size, body, timeout=60):
        assert got == [payload(r, r, salt=2).tolist() for r in (size - 1, 0)]


@pytest.mark.parametrize("roots,payloads,bounds,match", [
    ([0, 0], 2, 2, "distinct ranks"),
    ([0, 3], 2, 2, "distinct ranks"),
    ([-1], 1, 1, "distinct ranks"),
    ([], 0, 0, "distinct ranks"),
    ([True], 1, 1, "distinct ranks"),
    ([1.0], 1, 1, "distinct ranks"),
    ([0, 1], 1, 2, "2 roots need as many payloads and bounds, got 1 and 2"),
    ([0, 1], 2, 3, "2 roots need as many payloads and bounds, got 2 and 3"),
])
def test_roots_are_checked_on_every_rank_before_anything_moves(roots, payloads, bounds, match):
    def body(rank, tr):
        for op in ("gather_many", "broadcast_many", "gather_many_tensor",
                   "broadcast_many_tensor"):
            tensor = op.endswith("tensor")
            p = torch.zeros(1, dtype=torch.uint8) if tensor else np.zeros(1, np.uint8)
            args = ([p] * payloads, roots, [None] * bounds) if op.startswith("gather") else \
                (p, roots, [None] * bounds)
            if op.startswith("broadcast") and payloads != len(roots):
                continue   # broadcasts take one payload: only the bounds can mismatch
            with pytest.raises(ValueError, match=match):
                getattr(tr, op)(*args)
        return tr.stats.calls

    assert run_ranks(3, body, timeout=30) == [0, 0, 0]


@pytest.mark.parametrize("op", ["gather_many", "broadcast_many"])
def test_a_payload_over_its_bound_is_refused(op):
    def body(rank, tr):
        roots = [2, 0]
        if op == "gather_many":
            # Rank 1's payload to root 0 (the second root) is one byte over its bound.
            payloads = [np.zeros(4, np.uint8), np.zeros(6 if rank == 1 else 5, np.uint8)]
            return tr.gather_many(payloads, roots, [4, 5])
        mine = np.zeros(9 if rank == 0 else 3, np.uint8) if rank in roots else None
        return tr.broadcast_many(mine, roots, [3, 8])

    with pytest.raises(RuntimeError) as info:
        run_ranks(3, body, timeout=30)
    who = 1 if op == "gather_many" else 0
    assert isinstance(info.value.__cause__, ValueError)
    assert f"rank {who}: {op.split('_')[0]} payload of" in str(info.value)
    assert "exceeds the announced bound" in str(info.value)


@pytest.mark.parametrize("offset", [0, 3, 8, 13])
def test_a_frame_written_inside_a_larger_buffer_round_trips(offset):
    """Gloo's gather_many lays every root's frame into one all_to_all_single input, where a
    frame may start at any byte: its length word is written alike there."""
    from hvd_slim.transport.torch_frames import Frames, fill
    buf = torch.full((offset + 8 + 9,), 255, dtype=torch.uint8)
    frame = buf[offset:]
    fill(frame, torch.arange(5, dtype=torch.uint8) + 1)
    assert buf[:offset].tolist() == [255] * offset
    (n,) = Frames.lengths([frame], 9, [0], "gather")
    assert n == 5 and frame[8:8 + n].tolist() == [1, 2, 3, 4, 5] and frame[8 + n:].sum() == 0
