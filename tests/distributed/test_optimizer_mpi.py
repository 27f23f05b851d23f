"""DistributedOptimizer under mpirun: every rank runs these tests in the same order.

They pass at any world size and compare against closed forms or a dense MPI reference
(mpi4py's own Allreduce, independent of hvd_slim's code).
"""
import copy
import hashlib
import warnings

import pytest
import torch
from mpi4py import MPI

import hvd_slim as hvd

COMM = MPI.COMM_WORLD


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same start on every rank, as broadcast_parameters would give
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 64)
        self.head = torch.nn.Linear(64, 4)
        self.side = torch.nn.Linear(64, 4)

    def forward(self, x, use_side=False):
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.relu(self.fc(h))
        return self.side(h) if use_side else self.head(h)


def batch(step, rank=None):
    rank = hvd.rank() if rank is None else rank
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def wrap(model, opt=None, **kw):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw.setdefault("min_compress_numel", 1000)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def loss_of(model, step, **kw):
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x, **kw), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_grads(model):
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in model.parameters()]).double()


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def assert_same_on_every_rank(t):
    digests = COMM.allgather(digest(t))
    assert len(set(digests)) == 1, f"replicas differ: {digests}"


def mpi_mean(t):
    buf = t.detach().double().numpy().copy()
    COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf / COMM.Get_size())


def held_residual(opt, model):
    """Every residual this rank holds (its worker's and, on the server, the server's), as one
    float64 vector in ``model.named_parameters()`` order (zero where nothing is compressed)."""
    ex = opt._exchange
    offsets, off = {}, 0
    for name, p in model.named_parameters():
        offsets[name] = off
        off += p.numel()
    out = torch.zeros(off, dtype=torch.float64)
    held = ex.held_residuals()   # the server's shard (if any) included
    for b in ex.layout.sparse:
        r = held[b.index]
        for s in b.segments:
            o = offsets[s.name]
            out[o:o + s.numel] += r[s.offset:s.offset + s.numel]
    return out


def train(model, opt, steps):
    """``steps`` plain training steps (zero_grad, backward, step), the last update landed."""
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    opt.apply_updates()


def dense_step(ref, ref_opt, t):
    """The reference: one step of the plain optimizer on MPI-averaged gradients."""
    ref_opt.zero_grad()
    loss_of(ref, t).backward()
    for p in ref.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        p.grad = mpi_mean(g).to(p.dtype)
    ref_opt.step()


def servers_of(spec):
    """A ``servers`` value: 1, or one server shard per rank ("all")."""
    return COMM.Get_size() if spec == "all" else spec


def variant(name):
    """The exchange's shape: flat, hosts first (``hierarchical=True``: the ranks of this
    machine are one host, MPI's shared-memory split, so the host phases carry everything and
    each cross exchange has one rank), or overlapped with backward in 3 stages (and with the
    next forward: ``overlap_forward``), or both (each stage hosts first); or at other value
    bits ("signs": every coordinate's sign pushed, half the server's sum pulled at 8 bits, or
    all of it)."""
    signs = {"density": 1.0, "value_bits": 1, "pull_density": 0.5, "pull_value_bits": 8}
    return {"flat": {}, "hier": {"hierarchical": True}, "overlap": {"overlap": 3},
            "forward": {"overlap": 3, "overlap_forward": True},
            "hier-overlap": {"hierarchical": True, "overlap": 3},
            "hier-forward": {"hierarchical": True, "overlap": 3, "overlap_forward": True},
            "4-bit": {"value_bits": 4}, "2-bit": {"value_bits": 2}, "signs": signs,
            "hier-overlap-signs": dict(signs, hierarchical=True, overlap=3),
            "signs-pull-all": dict(signs, pull_density=1.0)}[name]


@pytest.mark.parametrize("pull, servers, shape", [
    ("slim", 1, "flat"), ("union", 1, "flat"), ("slim", "all", "flat"), ("union", "all", "flat"),
    ("slim", 1, "hier"), ("union", 1, "hier"), ("slim", 1, "overlap"), ("slim", "all", "overlap"),
    ("slim", "all", "forward"), ("slim", "all", "4-bit"), ("union", 1, "2-bit"),
    ("slim", 1, "hier-overlap"), ("slim", 1, "hier-forward"), ("slim", "all", "signs"),
    ("union", 1, "signs"), ("slim", 1, "hier-overlap-signs"),
    ("slim", "all", "signs-pull-all")])
def test_fifty_steps_keep_replicas_identical(pull, servers, shape):
    model = Net()
    opt = wrap(model, **dict(dict(density=0.01, pull=pull, servers=servers_of(servers)),
                             **variant(shape)))
    train(model, opt, 50)
    assert_same_on_every_rank(flat(model))
    assert opt.comm_stats()["steps"] == 50


INNER = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
         "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
         "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)}


@pytest.mark.parametrize("servers, shape", [(1, "flat"), ("all", "flat"), (1, "hier"),
                                           (1, "overlap"), (1, "forward"), (1, "hier-forward")])
@pytest.mark.parametrize("inner", sorted(INNER))
def test_density_one_matches_mpi_allreduce_averaging(inner, servers, shape):
    """The parity test: density 1.0 sends every bucket dense, so the wrapped optimizer's own
    step runs on the exact average (momentum correction and optim/inner/adam.py stay out of it),
    with one server or a server shard per rank."""
    model, ref = Net(), Net()
    opt = wrap(model, opt=INNER[inner](model.parameters()), density=1.0,
               servers=servers_of(servers), **variant(shape))
    ref_opt = INNER[inner](ref.parameters())
    for t in range(10):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        dense_step(ref, ref_opt, t)
    opt.apply_updates()
    assert torch.allclose(flat(model), flat(ref), rtol=1e-6, atol=1e-6)


def test_adam_at_one_percent_keeps_replicas_identical():
    """The gradient exchange: after 3 dense warm-up steps hvd_slim steps the compressed
    parameters itself (optim/inner/adam.py): parameters and Adam's state stay bitwise equal on every
    rank."""
    model = Net()
    opt = wrap(model, opt=torch.optim.Adam(model.parameters(), lr=1e-3), density=0.01,
               warmup_dense_steps=3, adam_exchange="gradient")
    train(model, opt, 20)
    assert_same_on_every_rank(flat(model))
    states = [opt.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()]
    assert_same_on_every_rank(torch.cat(states))
    assert any("last_delivery" in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("servers, shape", [(1, "flat"), ("all", "flat"), (1, "hier")])
def test_adam_update_exchange_keeps_replicas_identical(servers, shape):
    """The update exchange (AdamW's default): each rank's own moments, the same delivered
    update everywhere, hosts first or sharded servers alike; a checkpoint resumes bitwise."""
    model = Net()
    make = lambda m: wrap(m, opt=torch.optim.AdamW(m.parameters(), lr=1e-3),  # noqa: E731
                          servers=servers_of(servers), **variant(shape))
    opt = make(model)
    assert opt.slim_config.adam_exchange == "update"
    train(model, opt, 12)
    assert_same_on_every_rank(flat(model))
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    train(model, opt, 4)
    twin = Net()
    twin.load_state_dict(saved[0])
    twin_opt = make(twin)
    twin_opt.load_state_dict(saved[1])
    train(twin, twin_opt, 4)
    assert torch.equal(flat(model), flat(twin))


@pytest.mark.parametrize("servers, shape", [(1, "flat"), ("all", "flat"), (1, "hier"),
                                           ("all", "overlap"), (1, "2-bit"),
                                           (1, "hier-overlap")])
def test_conservation_at_one_percent(servers, shape):
    """op=Sum: everything pulled + the servers' residuals + every worker's residual equals the
    sum over ranks and steps of every gradient computed."""
    model = Net()
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.01), density=0.01, op=hvd.Sum,
               servers=servers_of(servers), **variant(shape))
    fed = torch.zeros_like(flat(model), dtype=torch.float64)
    pulled = torch.zeros_like(fed)
    for t in range(10):
        opt.zero_grad()
        loss_of(model, t).backward()
        fed += flat_grads(model)
        opt.synchronize()
        pulled += flat_grads(model)
        with opt.skip_synchronize():
            opt.step()
    ex = opt._exchange
    residual = held_residual(opt, model)
    size = COMM.Get_size()
    lhs = pulled + mpi_mean(residual) * size  # pulled is identical on every rank
    rhs = mpi_mean(fed) * size
    assert torch.allclose(lhs, rhs, rtol=1e-5, atol=1e-5)
    assert ex.residual_norm() > 0  # something really was held back


def test_a_server_per_rank_spreads_the_traffic():
    """Counted by the transport: with a server per rank no rank moves much more than the
    others (with one server, the server receives every push)."""
    model = Net()
    opt = wrap(model, density=0.01, servers=COMM.Get_size(), warmup_decay_steps=0)
    train(model, opt, 4)
    st = opt.comm_stats()
    moved = COMM.allgather(st["bytes_sent"] + st["bytes_received"])
    assert st["bytes_sent"] >= st["bytes_pushed"] > 0
    assert max(moved) <= 1.5 * sum(moved) / len(moved), moved
    assert_same_on_every_rank(flat(model))


@pytest.mark.parametrize("bits", [8, 32])
def test_wire_size_per_step(bits):
    model = Net()
    opt = wrap(model, density=0.01, value_bits=bits, warmup_decay_steps=0)
    (b,) = opt._layout.sparse
    from hvd_slim.wire.indices import index_bytes_bound
    for t in range(3):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        last = opt.comm_stats()["last_step"]
        assert last["push_sparse_value_bytes"] == b.k * bits // 8
        assert 0 < last["push_index_bytes"] <= index_bytes_bound(b.numel, b.k_core)
        assert last["push_index_bytes"] <= 2 * b.k_core
        parts = (last["push_header_bytes"] + last["push_dense_value_bytes"]
                 + last["push_sparse_value_bytes"] + last["push_index_bytes"])
        assert last["bytes_pushed"] == parts + 8


@pytest.mark.parametrize("shape", ["flat", "hier", "overlap", "forward", "hier-overlap"])
def test_unused_parameters_on_one_rank(shape):
    model = Net()
    opt = wrap(model, density=0.05, **variant(shape))
    for t in range(4):
        opt.zero_grad()
        loss_of(model, t, use_side=(hvd.rank() % 2 == 1)).backward()
        opt.step()
    opt.apply_updates()
    assert_same_on_every_rank(flat(model))


def test_clipping_between_synchronize_and_skip_synchronize():
    model = Net()
    opt = wrap(model, density=0.05)
    opt.zero_grad()
    (loss_of(model, 0) * 1000).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = flat_grads(model).norm()
    assert norm <= 0.01 + 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    assert_same_on_every_rank(flat(model))


def test_zero_grad_guard():
    model = Net()
    opt = wrap(model)
    loss_of(model, 0).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_no_named_parameters():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), density=0.05,
                                   min_compress_numel=1000)
    train(model, opt, 3)
    assert_same_on_every_rank(flat(model))


def test_backward_passes_per_step_two_matches_dense_reference():
    model, ref = Net(), Net()
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.05), density=1.0,
               backward_passes_per_step=2)
    opt.zero_grad()
    loss_of(model, 0).backward()
    loss_of(model, 1).backward()
    opt.step()
    loss_of(ref, 0).backward()
    loss_of(ref, 1).backward()
    for p in ref.parameters():
        p.data -= 0.05 * mpi_mean(torch.zeros_like(p) if p.grad is None else p.grad).float()
    assert torch.allclose(flat(model), flat(ref), atol=1e-6)


@pytest.mark.parametrize("shape", ["flat", "hier", "overlap", "hier-overlap"])
def test_flush_zeroes_every_residual_and_applies_everything(shape):
    """loss = sum(p * c): gradients do not depend on p, so the flushed model has a closed form."""
    model = Net()
    p0 = flat(model).clone()
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.5), density=0.01,
               **variant(shape))
    coeffs = torch.zeros_like(p0)
    for t in range(5):
        g = torch.Generator().manual_seed(31 * hvd.rank() + t)
        c = torch.randn(p0.shape, generator=g)
        coeffs += c
        opt.zero_grad()
        (flat_params_dot(model, c)).backward()
        opt.step()
    assert opt._exchange.residual_norm() > 0
    opt.flush()
    assert opt._exchange.residual_norm() == 0.0
    expected = p0 - 0.5 * mpi_mean(coeffs).float()
    assert torch.allclose(flat(model), expected, atol=1e-5)


def flat_params_dot(model, c):
    return (torch.cat([p.reshape(-1) for p in model.parameters()]) * c).sum()


@pytest.mark.parametrize("shape", ["flat", "hier", "overlap", "forward", "hier-forward"])
def test_state_dict_round_trip_continues_bitwise(shape):
    def run(split):
        model = Net()
        opt = wrap(model, density=0.02, **variant(shape))
        for t in range(8):
            if t == split:
                sd_m, sd_o = model.state_dict(), opt.state_dict()
                model = Net()
                opt = wrap(model, density=0.02, **variant(shape))
                model.load_state_dict(sd_m)
                opt.load_state_dict(sd_o)
            opt.zero_grad()
            loss_of(model, t).backward()
            opt.step()
        opt.apply_updates()
        return flat(model)

    assert torch.equal(run(-1), run(4))


def test_warmup_is_dense_momentum_sgd_then_decays_with_replicas_identical():
    """warmup_dense_steps: the same parameters as dense momentum SGD on MPI-averaged gradients;
    then the decay steps push less every step, and replicas stay bitwise identical."""
    dense, decay = 4, 4
    model, ref = Net(), Net()
    opt = wrap(model, density=0.01, warmup_dense_steps=dense, warmup_decay_steps=decay)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    pushed = []
    for t in range(dense + decay + 2):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        pushed.append(opt.comm_stats()["last_step"]["bytes_pushed"])
        if t < dense:
            dense_step(ref, ref_opt, t)
        if t == dense - 1:
            assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6)
    assert_same_on_every_rank(flat(model))
    if hvd.rank() != 0:   # the server's own push is not counted by a transport
        assert pushed[0] == pushed[dense - 1]
        assert all(a > b for a, b in zip(pushed[dense - 1:dense + decay],
                                         pushed[dense:dense + decay + 1])), pushed
        assert pushed[-1] == pushed[-2] < 0.1 * pushed[0], pushed


@pytest.mark.parametrize("density", [1.0, 0.05])
def test_local_steps_land_every_rank_on_the_same_global_parameters(density):
    """local_steps=4: mid-round every rank has its own parameters; after each round all hold
    the same global ones. At density 1.0 with outer SGD lr 1 (no momentum) a round's result is
    the MPI average of the ranks' local parameters."""
    model = Net()
    outer = torch.optim.SGD(model.parameters(), lr=1.0) if density == 1.0 else None
    opt = wrap(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3), density=density,
               local_steps=4, outer_optimizer=outer)
    locals_ = []
    load = opt._outer.load_pseudo_gradients
    opt._outer.load_pseudo_gradients = lambda: (locals_.append(flat(model).double()), load())[1]
    for t in range(12):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        if t % 4 == 3:
            assert_same_on_every_rank(flat(model))
            if density == 1.0:
                assert torch.allclose(flat(model).double(), mpi_mean(locals_[-1]), atol=1e-6)
    assert opt.comm_stats()["steps"] == 3


def test_delayed_outer_steps_land_one_round_late_on_every_rank():
    """outer_delay=1 at density 1.0, outer SGD lr 1: round r's exchange runs during round r+1,
    which each rank trains on from where it was, so after round r's end the global parameters
    are the MPI mean of the ranks' local parameters at round r-1's end."""
    model = Net()
    start = flat(model).double()
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = wrap(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3), density=1.0,
               local_steps=2, outer_delay=1, outer_optimizer=outer)
    locals_, globals_ = [], []
    progress = opt._ends._progress   # read at each round's end, before anything moves
    opt._ends._progress = lambda: (locals_.append(flat(model).double()), progress())[1]
    for t in range(6):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        if t % 2 == 1:
            g = torch.cat([x.reshape(-1) for x in opt._outer.global_params]).double()
            assert_same_on_every_rank(g)
            globals_.append(g)
    assert torch.equal(globals_[0], start)   # round 0 is still in flight
    assert torch.allclose(globals_[1], mpi_mean(locals_[0]), atol=1e-6)
    assert torch.allclose(globals_[2], mpi_mean(locals_[1]), atol=1e-6)
    opt.flush()
    assert_same_on_every_rank(flat(model))
    assert opt.comm_stats()["steps"] == 3
