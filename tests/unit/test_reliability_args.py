"""Bad arguments are rejected when the optimizer is built, naming the argument (or the
HVD_SLIM_* variable it came from) and what would be accepted (issue 6, "Bad arguments")."""
import numpy as np
import pytest
import torch

import hvd_slim
from hvd_slim.config import ENV_KEYWORDS, ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.transport import FakeCluster


def _model_and_opt(opt_cls=torch.optim.SGD, **opt_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 3))
    return model, opt_cls(model.parameters(), **(opt_kw or {"lr": 0.1}))


def build(size=1, opt_cls=torch.optim.SGD, opt_kw=None, **kw):
    model, opt = _model_and_opt(opt_cls, **(opt_kw or {}))
    kw.setdefault("transport", FakeCluster(size).transport(0))
    kw.setdefault("named_parameters", model.named_parameters())
    return hvd_slim.DistributedOptimizer(opt, **kw)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENV_KEYWORDS:
        monkeypatch.delenv("HVD_SLIM_" + name.upper(), raising=False)


# --- keywords ---------------------------------------------------------------------------------
BAD_FRACTIONS = [0.0, -0.1, 1.5, float("inf"), float("-inf"), "x", None, True, [0.1],
                 float("nan")]
# exploration=0 is valid (no exploration); pull_density=None means "the same as density".
FRACTION_CASES = [(name, low_open, v) for name, low_open in (("density", True),
                                                             ("pull_density", True),
                                                             ("exploration", False))
                  for v in BAD_FRACTIONS
                  if not (v == 0.0 and name == "exploration") and not (v is None and
                                                                       name == "pull_density")]


@pytest.mark.parametrize("name, low_open, value", FRACTION_CASES)
def test_fractions_out_of_range_nan_or_not_numbers(name, low_open, value):
    rng = r"\(0, 1\]" if low_open else r"\[0, 1\]"
    with pytest.raises(ValueError, match=rf"^{name} must be .*in {rng}, got"):
        build(**{name: value})


@pytest.mark.parametrize("kw, match", [
    (dict(warmup_dense_steps=-3), r"^warmup_dense_steps must be >= 0, got -3"),
    (dict(warmup_dense_steps=1.5), r"^warmup_dense_steps must be an integer >= 0"),
    (dict(backward_passes_per_step=0), r"^backward_passes_per_step must be >= 1"),
    (dict(backward_passes_per_step="2"), r"^backward_passes_per_step must be an integer >= 1"),
    (dict(server_rank=2), r"^server_rank must be in \[0, 2\) for a job of 2 ranks, got 2"),
    (dict(server_rank=-1), r"^server_rank must be >= 0"),
    (dict(min_compress_numel=-1), r"^min_compress_numel must be >= 0"),
    (dict(pull="both"), r"^pull must be one of \('slim', 'union'\), got 'both'"),
    (dict(value_bits=3), r"^value_bits must be one of \(1, 2, 4, 8, 16, 32\), got 3"),
    (dict(servers=0), r"^servers must be >= 1, got 0"),
    (dict(servers=3), r"^servers must be an integer in 1\.\.2 \(the ranks of the exchange\) "
                      r"or 'auto', got 3"),
    (dict(servers="many"), r"^servers must be an integer >= 1 or 'auto', got 'many'"),
    (dict(servers=1.5), r"^servers must be an integer >= 1, got 1.5"),
    (dict(hierarchical="yes"), r"^hierarchical must be True or False, got 'yes'"),
    (dict(hierarchical=True), r"^hierarchical=True needs the job's own transport \('mpi', "
                              r"'gloo' or 'nccl'\), not 'fake'"),
    (dict(overlap=0), r"^overlap must be >= 1, got 0"),
    (dict(overlap="on"), r"^overlap must be True, False or an integer number of stages >= 1, "
                         r"got 'on'"),
    (dict(overlap=2, hierarchical=True), r"^hierarchical=True needs the job's own "
                                         r"transport \('mpi', 'gloo' or 'nccl'\), not 'fake'"),
    (dict(overlap_forward="yes"), r"^overlap_forward must be True or False, got 'yes'"),
    (dict(overlap_forward=True), r"^overlap_forward=True needs overlap > 1 \(overlap=1\)"),
    (dict(local_steps=0), r"^local_steps must be >= 1, got 0"),
    (dict(local_steps=2.5), r"^local_steps must be an integer >= 1, got 2.5"),
    (dict(local_steps=4, overlap=2), r"^local_steps > 1 cannot be combined with overlap > 1"),
    (dict(outer_optimizer="sgd", local_steps=4),
     r"^outer_optimizer must be a torch.optim.Optimizer over the model's parameters"),
    (dict(value_bits=True), r"^value_bits must be one of \(1, 2, 4, 8, 16, 32\), got True"),
    (dict(value_bits=8.5), r"^value_bits must be one of \(1, 2, 4, 8, 16, 32\), got 8.5"),
    (dict(warmup_start_density=0.001, density=0.01),
     r"^warmup_start_density \(0.001\) must not be below density \(0.01\)"),
    (dict(warmup_decay_steps=-1), r"^warmup_decay_steps must be >= 0"),
    (dict(transport="carrier-pigeon"), r"transport='carrier-pigeon' is not a transport"),
    (dict(op=hvd_slim.api.collectives.Sum, gradient_predivide_factor=2.0),
     r"gradient_predivide_factor not supported with op != Average"),
    (dict(gradient_predivide_factor=float("nan")), r"gradient_predivide_factor must be a finite"),
    (dict(gradient_predivide_factor=0), r"gradient_predivide_factor must be a finite number > 0"),
    (dict(magnitude_weight=-1.0), r"^magnitude_weight must be a finite number >= 0"),
    (dict(seed=-1), r"^seed must be >= 0"),
    (dict(momentum_correction="yes"), r"^momentum_correction must be True, False or None"),
    (dict(nonfinite="ignore"), r"^nonfinite must be one of \('flag', 'skip', 'raise', 'propagate'\)"),
    (dict(timeout=-1), r"^timeout must be a number of seconds > 0, or 0/None"),
    (dict(timeout=float("nan")), r"^timeout must be a number of seconds"),
    (dict(timeout="soon"), r"^timeout must be a number of seconds"),
    (dict(sparse_average="mean"), r"^sparse_average must be one of \('ranks', 'senders'\)"),
    (dict(sparse_average="senders", pull="union"),
     r"^sparse_average='senders' .*needs op=Average, pull='slim'.*pull='union'"),
    (dict(sparse_average="senders", op=hvd_slim.api.collectives.Sum),
     r"^sparse_average='senders' .*op is not Average"),
])
def test_out_of_range_keywords(kw, match):
    with pytest.raises(ValueError, match=match):
        build(size=2, **kw)


def test_unknown_keyword_is_a_type_error_naming_it():
    """The signature names every Slim-DP keyword (an IDE shows them), so Python itself refuses
    a misspelt one."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'densty'"):
        build(densty=0.1)


def test_the_signature_names_every_slim_dp_keyword_keyword_only():
    import inspect
    from hvd_slim.config import UNSET
    from hvd_slim.optim.wrapping import SLIM_KEYWORDS
    params = inspect.signature(hvd_slim.DistributedOptimizer).parameters
    slim = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert slim == SLIM_KEYWORDS
    assert all(params[n].default is UNSET for n in slim)


def test_named_parameters_duplicate_missing_and_malformed():
    model, opt = _model_and_opt()
    named = list(model.named_parameters())
    tr = FakeCluster(1).transport(0)
    with pytest.raises(ValueError, match=r"unique\. Found duplicates: 0\.weight"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=named + named[:1], transport=tr)
    with pytest.raises(ValueError, match=r"not named \(1 of shapes \(60, 40\)\)"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=named[1:], transport=tr)
    with pytest.raises(ValueError, match="tuples"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=[p for _, p in named], transport=tr)


def test_numpy_scalars_are_accepted_and_normalised():
    """A density computed with numpy must not make one rank's digest differ from another's."""
    opt = build(density=np.float64(0.05), warmup_dense_steps=np.int64(2), seed=np.int32(3))
    cfg = opt.slim_config
    assert type(cfg.density) is float and type(cfg.warmup_dense_steps) is int
    # adam_exchange is resolved for the optimizer ("gradient" for SGD) when it is built.
    assert cfg.digest() == SlimConfig(density=0.05, warmup_dense_steps=2, seed=3,
                                      adam_exchange="gradient").digest()


def test_new_keywords_have_defaults_and_take_values():
    cfg = build().slim_config
    assert cfg.nonfinite == "flag" and cfg.timeout == 600.0
    cfg = build(nonfinite="skip", timeout=0).slim_config
    assert cfg.nonfinite == "skip" and cfg.timeout is None   # 0 waits forever


# --- the same checks from HVD_SLIM_* ----------------------------------------------------------
BAD_ENV = [
    ("density", "0"), ("density", "abc"), ("density", "nan"),
    ("exploration", "2"), ("exploration", "nan"),
    ("magnitude_weight", "-1"), ("magnitude_weight", "inf"),
    ("momentum_correction", "maybe"),
    ("pull", "both"),
    ("pull_density", "0"), ("pull_density", "x"),
    ("min_compress_numel", "-5"), ("min_compress_numel", "many"),
    ("server_rank", "-1"), ("server_rank", "7"),
    ("seed", "-3"), ("seed", "x"),
    ("nonfinite", "ignore"),
    ("timeout", "-1"), ("timeout", "soon"),
    ("warmup_dense_steps", "-1"), ("warmup_dense_steps", "2.5"),
    ("warmup_decay_steps", "-2"), ("warmup_decay_steps", "later"),
    ("adam_variance", "frozen"), ("adam_exchange", "sometimes"), ("pull_value_bits", "3"),
    ("momentum_masking", "auto"),
    ("value_bits", "3"), ("value_bits", "eight"),
    ("warmup_start_density", "0"), ("warmup_start_density", "dense"),
    ("servers", "0"), ("servers", "many"), ("servers", "3"),
    ("hierarchical", "maybe"),
    ("overlap", "0"), ("overlap", "2.5"), ("overlap", "lots"),
    ("overlap_forward", "maybe"),
    ("local_steps", "0"), ("local_steps", "many"),
    ("outer_delay", "2"), ("outer_delay", "soon"),
    ("residual_decay", "0"), ("residual_decay", "1.5"), ("residual_decay", "fast"),
    ("warmup_settle", "0"), ("warmup_settle", "soon"),
    ("sparse_average", "some"),
]


def test_every_environment_keyword_is_covered():
    assert {name for name, _ in BAD_ENV} == set(ENV_KEYWORDS)


@pytest.mark.parametrize("name, text", BAD_ENV)
def test_bad_environment_values_name_the_variable(monkeypatch, name, text):
    var = "HVD_SLIM_" + name.upper()
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError) as info:
        build(size=2)
    msg = str(info.value)
    assert var in msg and name in msg, msg
    # The message says what is accepted (a range, a list or a form).
    assert any(hint in msg for hint in ("[0, ", "(0, 1]", ">=", "one of", "true, false",
                                        "integer", "number", "seconds")), msg


@pytest.mark.parametrize("name, text", BAD_ENV)
def test_an_explicit_keyword_beats_a_bad_variable(monkeypatch, name, text):
    monkeypatch.setenv("HVD_SLIM_" + name.upper(), text)
    good = {"density": 0.05, "exploration": 0.2, "magnitude_weight": 0.0,
            "momentum_correction": None, "pull": "union", "pull_density": 0.05,
            "min_compress_numel": 100, "server_rank": 1, "seed": 4, "nonfinite": "skip",
            "timeout": 30, "warmup_dense_steps": 10, "warmup_decay_steps": 20,
            "adam_variance": "live", "momentum_masking": False, "value_bits": 16,
            "warmup_start_density": 0.5, "servers": 2, "hierarchical": False,
            "overlap": 2, "overlap_forward": False, "local_steps": 8, "outer_delay": 0, "residual_decay": 0.9,
            "adam_exchange": "gradient", "pull_value_bits": 4, "warmup_settle": 0.5,
            "sparse_average": "senders"}[name]
    assert getattr(build(size=2, **{name: good}).slim_config, name) == good


def test_momentum_correction_from_the_environment_is_named_when_it_cannot_apply(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_MOMENTUM_CORRECTION", "true")
    with pytest.raises(ValueError, match=r"needs torch.optim.SGD with momentum.*"
                                         r"HVD_SLIM_MOMENTUM_CORRECTION"):
        build(opt_cls=torch.optim.Adam, opt_kw={"lr": 0.1}, min_compress_numel=100)


def test_servers_from_the_environment(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_SERVERS", "Auto")
    assert build(size=2).slim_config.servers == "auto"
    monkeypatch.setenv("HVD_SLIM_SERVERS", "2")
    assert build(size=2).slim_config.servers == 2


def test_overlap_from_the_environment(monkeypatch):
    for text, stages in (("true", 4), ("off", 1), ("3", 3), ("1", 1)):
        monkeypatch.setenv("HVD_SLIM_OVERLAP", text)
        assert build(size=2).slim_config.overlap == stages, text


def test_good_environment_values_are_used(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_NONFINITE", "Skip")
    monkeypatch.setenv("HVD_SLIM_TIMEOUT", "none")
    monkeypatch.setenv("HVD_SLIM_MIN_COMPRESS_NUMEL", "1e3")
    cfg = build().slim_config
    assert cfg.nonfinite == "skip" and cfg.timeout is None and cfg.min_compress_numel == 1000


def test_resolve_config_reports_the_field_of_every_error():
    for name, text in BAD_ENV:
        if (name, text) in (("server_rank", "7"), ("servers", "3")):
            continue  # needs the world size: checked by check_world (above)
        with pytest.raises(ConfigError) as info:
            resolve_config({}, {"HVD_SLIM_" + name.upper(): text})
        assert info.value.field == name, (name, text, info.value.field)


def test_the_removed_refresh_interval_is_refused_as_keyword_and_variable(monkeypatch):
    """refresh_interval is gone (docs/accuracy.md: harmful on every seed): passing it is a
    TypeError, and a leftover HVD_SLIM_REFRESH_INTERVAL is refused rather than ignored."""
    with pytest.raises(TypeError, match="refresh_interval"):
        build(refresh_interval=2)
    monkeypatch.setenv("HVD_SLIM_REFRESH_INTERVAL", "1")
    with pytest.raises(ConfigError, match="HVD_SLIM_REFRESH_INTERVAL .*removed"):
        build()
