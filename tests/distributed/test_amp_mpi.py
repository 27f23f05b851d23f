"""Mixed precision under mpirun with the default ``nonfinite="flag"``: Horovod's GradScaler
pattern (synchronize, unscale_, step inside skip_synchronize, update) trains through
overflows, every rank's scaler skips and backs off alike, and the replicas stay bitwise
identical at every step."""
import hashlib

import pytest
import torch

import hvd_slim as hvd


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def digest(model):
    data = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def amp_train(steps, dtype, init_scale, growth_interval, overflow=(), tell=False):
    """Train with torch.amp.GradScaler; ``dtype``: the autocast dtype (None: float32 only);
    ``overflow``: the (rank, step)s whose loss is made to overflow; ``tell``: the optimizer is
    given the scaler (its residuals in true units). Per step: the scale after update(),
    whether the parameters moved, and every rank's parameter hash."""
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.02,
                                   min_compress_numel=1000)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    if tell:
        opt.set_grad_scaler(scaler)
    scales, moved, hashes = [], [], []
    for t in range(steps):
        g = torch.Generator().manual_seed(7919 * hvd.rank() + t)
        x, y = torch.randn(16, 48, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if (hvd.rank(), t) in overflow:
            loss = loss * 1e38   # finite, Inf once scaled: on this rank only
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = digest(model)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(digest(model) != before)
        hashes.append(hvd.allgather_object(digest(model)))
    return scales, moved, hashes, opt.comm_stats()["skipped_steps"]


def assert_identical(hashes):
    for t, row in enumerate(hashes):
        assert len(set(row)) == 1, f"replicas differ after step {t}: {row}"


@pytest.mark.parametrize("tell", [False, True], ids=["untold", "told"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_forced_overflow_on_one_rank_skips_and_backs_off_everywhere(dtype, tell):
    last = hvd.size() - 1
    scales, moved, hashes, skipped = amp_train(8, dtype, 2.0 ** 8, 2, {(last, 2), (last, 5)},
                                               tell=tell)
    assert_identical(hashes)
    # growth_interval=2: doubles after two clean steps, halves at each overflow
    assert scales == [256.0, 512.0, 256.0, 256.0, 512.0, 256.0, 256.0, 512.0]
    assert moved == [t not in (2, 5) for t in range(8)] and skipped == 2
    assert len(set(map(tuple, hvd.allgather_object(scales)))) == 1


def test_float16_autocast_overflows_naturally_and_the_scale_settles_on_every_rank():
    """A scale too large for float16 activations' gradients: each rank's backward overflows
    on its own data, the scalers all back off alike until it fits, then grow again."""
    scales, moved, hashes, skipped = amp_train(14, torch.float16, 2.0 ** 24, 3)
    assert_identical(hashes)
    assert all(len(set(row)) == 1 for row in zip(*hvd.allgather_object(scales)))
    assert len(set(hvd.allgather_object(skipped))) == 1 and skipped >= 1
    prev = [2.0 ** 24] + scales[:-1]
    downs = [t for t in range(14) if scales[t] < prev[t]]
    ups = [t for t in range(14) if scales[t] > prev[t]]
    assert downs and ups and downs[0] < ups[-1], scales
    assert all(not moved[t] for t in downs) and moved.count(False) == skipped
    assert any(moved)
