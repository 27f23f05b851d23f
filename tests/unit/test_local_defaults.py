"""``local_steps > 1`` at its defaults (config/settings.py's ``LOCAL_DEFAULTS``): SparseLoCo's
recipe over a sparse exchange, DiLoCo's outer Nesterov only for dense rounds (``density=1.0``);
what the user sets wins over both."""
import logging

import torch

import hvd_slim
from hvd_slim.config.settings import LOCAL_DEFAULTS, LOCAL_PULL_RATIO
from hvd_slim.transport import FakeCluster, run_ranks

from test_local_steps import batch, flat, model, one_step


def bare(m, tr, **kw):
    """The user's call: AdamW wrapped with no keyword but ``kw``."""
    return hvd_slim.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2),
                                         named_parameters=m.named_parameters(), transport=tr,
                                         **kw)


def outer_settings(opt):
    g = opt._outer.outer.param_groups[0]
    return g["lr"], g["momentum"], g["nesterov"]


def test_local_steps_alone_takes_sparselocos_recipe_and_says_so(caplog):
    m = model()
    with caplog.at_level(logging.INFO, logger="hvd_slim"):
        opt = bare(m, FakeCluster(1).transport(0), local_steps=8)
    cfg = opt._exchange.cfg
    for name, value in LOCAL_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
        shown = cfg.effective_dict()[name]   # the automatic warm-up: its count of rounds
        assert f"{name}={shown!r} (local-steps default)" in caplog.text, name
    assert cfg.pull_density == LOCAL_DEFAULTS["density"] * LOCAL_PULL_RATIO
    assert cfg.adam_exchange == "gradient"   # a round's pseudo-gradient is the update already
    # A warm-up ending on a signal, never longer than the count's 1/(0.01 * 8) = 13 rounds.
    assert (cfg.effective_warmup_decay_steps, cfg.warmup_settle) == (13, 0.5)
    assert outer_settings(opt) == (1.0, 0.0, False)
    assert "SGD(lr=1.0, momentum=0.0) (default)" in cfg.shared_dict()["outer_optimizer"]


def test_dense_rounds_keep_dilocos_outer_and_the_plain_defaults():
    m = model()
    opt = bare(m, FakeCluster(1).transport(0), local_steps=8, density=1.0)
    cfg = opt._exchange.cfg
    assert (cfg.value_bits, cfg.residual_decay, cfg.min_compress_numel) == (8, 1.0, 4096)
    assert outer_settings(opt) == (0.7, 0.9, True)


def test_what_the_user_sets_wins_over_the_local_defaults(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_RESIDUAL_DECAY", "0.9")
    m = model()
    outer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
    opt = bare(m, FakeCluster(1).transport(0), local_steps=4, density=0.03, value_bits=4,
               outer_optimizer=outer)
    cfg = opt._exchange.cfg
    assert (cfg.density, cfg.value_bits, cfg.residual_decay) == (0.03, 4, 0.9)
    assert cfg.pull_density == 0.03 * LOCAL_PULL_RATIO   # the pull follows the user's density
    assert cfg.min_compress_numel == 0 and cfg.pull_value_bits == 8
    assert opt._outer.outer is outer


def test_a_warm_up_the_user_turned_off_takes_no_signal_to_end_it():
    cfg = bare(model(), FakeCluster(1).transport(0), local_steps=8,
               warmup_decay_steps=0)._exchange.cfg
    assert (cfg.effective_warmup_decay_steps, cfg.warmup_settle) == (0, None)


def test_the_average_over_senders_gives_way_where_it_cannot_apply():
    """Local steps average a coordinate over the ranks that sent it, but not with the exact
    union pull or a Sum, which rule it out: those keep the mean over every rank."""
    for kw in ({"pull": "union"}, {"op": hvd_slim.Sum}):
        cfg = bare(model(), FakeCluster(1).transport(0), local_steps=8, **kw)._exchange.cfg
        assert cfg.sparse_average == "ranks", kw
    cfg = bare(model(), FakeCluster(1).transport(0), local_steps=8)._exchange.cfg
    assert cfg.sparse_average == "senders"


def test_ranks_with_other_local_steps_are_told_which_setting_differs():
    def body(rank, tr):
        m = model()
        opt = bare(m, tr, local_steps=4 if rank == 0 else 2, timeout=20)
        try:
            one_step(m, opt, rank, 0)
            one_step(m, opt, rank, 1)
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            return str(exc)
        return None

    msgs = run_ranks(2, body)
    assert all(m is not None and "local_steps" in m for m in msgs), msgs


def test_the_global_step_is_the_pulled_slice_itself():
    """Outer SGD at lr 1 with no momentum moves the global parameters by exactly what the pull
    delivered: only its coordinates change, every tensor (all compressed) included, and every
    rank holds the same global parameters."""
    def body(rank, tr, **kw):
        m = model()
        # (no warm-up, so the pull has its steady size from the first round)
        opt = bare(m, tr, local_steps=3, seed=2, warmup_decay_steps=0, **kw)
        for t in range(6):
            if t == 3:   # the second round: an outer momentum would move the first's too
                before = flat(m).clone()
            one_step(m, opt, rank, t)
        return before, flat(m)

    res = run_ranks(3, body)
    before, after = res[0]
    assert all(torch.equal(after, r[1]) for r in res[1:])
    moved = int((after != before).sum())
    numel = before.numel()
    pulled = LOCAL_DEFAULTS["density"] * LOCAL_PULL_RATIO * numel
    assert 0 < moved <= pulled + 8, (moved, pulled)   # + rounding of each bucket's slice
    small = [p.numel() for p in model().parameters() if p.numel() < 4096]
    assert small   # the model has small tensors, which the defaults compress as well


def test_resume_at_the_defaults_is_bitwise():
    def body(rank, tr, split):
        m = model()
        opt = bare(m, tr, local_steps=4, seed=7)
        for t in range(14):
            if t == split:
                state, weights = opt.state_dict(), {k: v.clone() for k, v in
                                                    m.state_dict().items()}
                m = model()
                m.load_state_dict(weights)
                opt = bare(m, tr, local_steps=4, seed=7)
                opt.load_state_dict(state)
            one_step(m, opt, rank, t)
        return flat(m), torch.cat([g.reshape(-1) for g in opt._outer.global_params])

    plain = run_ranks(2, lambda r, tr: body(r, tr, -1))
    resumed = run_ranks(2, lambda r, tr: body(r, tr, 6))
    for a, b in zip(plain, resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(plain[0][0], plain[1][0])   # mid-round: each rank its own


def test_a_checkpoint_from_dilocos_defaults_is_refused_naming_the_setting():
    tr = FakeCluster(1).transport(0)
    m = model()
    old = bare(m, tr, local_steps=4, density=0.02, value_bits=8)   # the defaults before
    x, y = batch(0, 0)
    old.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    old.step()
    try:
        bare(model(), tr, local_steps=4).load_state_dict(old.state_dict())
    except ValueError as exc:
        assert "config field 'density'" in str(exc)
    else:
        raise AssertionError("a checkpoint made at other settings was loaded")
