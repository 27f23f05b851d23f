"""Single-process tests of the convergence study's helpers (benchmarks/convergence/): the top-k baseline, the LR schedule, the dense
warm-up hand-over, the Horovod-missing message, the convergence plan and its report."""
from __future__ import annotations

import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks.convergence import plan as conv
from benchmarks.convergence import report, training
from benchmarks.convergence import train as mnist
from benchmarks.convergence.topk import TopKOptimizer


# One simulated rank: every collective is the identity.
SOLO = SimpleNamespace(size=lambda: 1, rank=lambda: 0, Average=0, Sum=1,
                       allgather=lambda t: t.clone(), allreduce=lambda t, op=None: t.clone())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))


def test_topk_sends_k_and_conserves_everything_computed():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    lr = 0.01
    inner = torch.optim.SGD(model.parameters(), lr=lr)  # no momentum: p moves by -lr * update
    opt = TopKOptimizer(inner, model.named_parameters(), 0.01, SOLO, min_compress_numel=1000)
    assert opt.k == 50  # 1% of the 5000-weight matrix; the rest is "small", sent dense
    total = torch.zeros(5000)
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(8, 100)).pow(2).sum().backward()
        total += model[0].weight.grad.reshape(-1)
        opt.step()
        assert int((model[0].weight.grad != 0).sum()) <= opt.k
    moved = (before[0] - model[0].weight.detach()).reshape(-1) / lr
    # Error feedback loses nothing: applied + residual = every gradient computed.
    assert torch.allclose(moved + opt.residual, total, rtol=1e-4, atol=1e-3)
    s = opt.comm_stats()
    assert s["steps"] == 5 and s["bytes_pushed"] == 5 * opt.k * 8 and s["modelled"]
    opt.flush()
    assert torch.allclose((before[0] - model[0].weight.detach()) / lr, total.view(50, 100),
                          rtol=1e-4, atol=1e-3)
    assert float(opt.residual.abs().sum()) == 0.0


def test_topk_rejects_a_bad_density():
    model = _model()
    with pytest.raises(ValueError, match="density"):
        TopKOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), 0,
                      SOLO)


def test_schedule_shapes():
    cos = training.Schedule(0.1, "cosine", floor=0.01)
    assert cos.at(0, 100) == pytest.approx(0.1)
    assert cos.at(50, 100) == pytest.approx(0.1 * (0.01 + 0.99 * 0.5))
    assert cos.at(100, 100) == pytest.approx(0.001)
    step = training.Schedule(1.0, "step")
    assert [step.at(s, 100) for s in (0, 49, 50, 75)] == [1.0, 1.0, 0.1, 0.01]
    warm = training.Schedule(1.0, "constant", warmup_steps=10)
    assert warm.at(0, 100) == pytest.approx(0.1) and warm.at(10, 100) == 1.0


def test_dense_warmup_hands_over_once_after_its_steps():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    built = []

    def make_main():
        built.append(TopKOptimizer(inner, model.named_parameters(), 0.1, SOLO, 1000))
        return built[-1]

    opt = training.DenseWarmup(inner, model, SOLO, 3, make_main)
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(4, 100)).sum().backward()
        opt.step()
        assert len(built) == (1 if step >= 2 else 0)
    assert opt.current is built[0] and opt.param_groups is inner.param_groups
    assert opt.comm_stats()["steps"] == 5


def test_horovod_missing_says_how_to_install(monkeypatch, capsys):
    real = importlib.import_module

    def fake_import(name, *args):
        if name.startswith("horovod"):
            raise ImportError("No module named 'horovod'")
        return real(name, *args)

    monkeypatch.setattr(training.importlib, "import_module", fake_import)
    with pytest.raises(training.HorovodMissing, match="make install-horovod"):
        training.runtime_for("horovod")
    assert mnist.main(["--method", "horovod"]) == 2  # before any MPI call
    err = capsys.readouterr().err
    assert "not installed" in err and "scripts/install_horovod.sh" in err


def test_mnist_passes_only_the_slim_keywords_given():
    args = mnist.build_parser().parse_args(["--pull", "union", "--momentum-correction", "off"])
    assert mnist.slim_kwargs(args) == {"pull": "union", "momentum_correction": False}
    assert mnist.slim_kwargs(mnist.build_parser().parse_args([])) == {}


def test_convergence_adam_group_compares_each_adam_setting_with_dense_adam():
    plan = conv.build_plan(["mnist"], ["adam"], [0], 4)
    assert all(s["optimizer"] == "adam" and s["lr"] == 1e-3 for s in plan)
    assert all(s["config"].endswith("adam") for s in plan)   # report: "dense adam" reference
    by = {s["config"]: s for s in plan}
    assert by["slim d=0.001 live-variance adam"]["slim"] == {"adam_variance": "live"}
    assert by["slim d=0.01 adam"]["slim"] == {}
    steps = 2 * math.ceil(15000 / 64)
    # These rows were measured decaying from dense: the start density says so.
    assert by["slim d=0.01 warm-up 5% dense + 10% decay adam"]["slim"] == {
        "warmup_dense_steps": int(0.05 * steps), "warmup_decay_steps": int(0.1 * steps),
        "warmup_start_density": 1.0}


def test_convergence_plan_is_the_issue_grid():
    plan = conv.build_plan(["mnist", "mnist1d"], ["grid"], [0, 1, 2], 4)
    assert len(plan) == 2 * 9 * 3 and len({s["key"] for s in plan}) == len(plan)
    slim = [s for s in plan if s["method"] == "slim"]
    assert {(s["density"], s["slim"]["pull"], s["slim"]["exploration"]) for s in slim} == {
        (d, p, e) for d in (0.01, 0.001) for p in ("slim", "union") for e in (0.0, 0.1)}
    for ds in ("mnist", "mnist1d"):  # same epochs and schedule for every run of a dataset
        assert len({(s["epochs"], s["lr"], s["schedule"], s["batch_size"])
                    for s in plan if s["dataset"] == ds}) == 1
    warm = [s for s in conv.build_plan(["mnist"], ["ablation"], [0], 4)
            if "dense_warmup_steps" in s]
    assert warm and warm[0]["dense_warmup_steps"] == int(0.1 * 2 * math.ceil(15000 / 64))
    steps = 2 * math.ceil(15000 / 64)   # hvd_slim's own warm-up: keywords, in steps
    own = {s["config"]: s["slim"] for s in conv.build_plan(["mnist"], ["ablation"], [0], 4)
           if "warmup_dense_steps" in s["slim"]}
    assert own["slim d=0.001 warm-up 10% dense"] == {"warmup_dense_steps": int(0.1 * steps),
                                                     "warmup_decay_steps": 0,
                                                     "warmup_start_density": 1.0}
    assert own["slim d=0.01 warm-up 5% dense + 10% decay"] == {
        "warmup_dense_steps": int(0.05 * steps), "warmup_decay_steps": int(0.1 * steps),
        "warmup_start_density": 1.0}


def _run(config, method, density, accs, seed):
    recs = [{"epoch": i + 1, "steps": 10 * (i + 1), "test_accuracy": a, "bytes_pushed": 100.0,
             "bytes_pulled": 100.0, "dense_bytes": 1000.0 * (i + 1)} for i, a in enumerate(accs)]
    recs[-1]["flushed_accuracy"] = accs[-1]
    return {"key": f"d/{config}/{seed}", "dataset": "d", "group": "grid", "config": config,
            "method": method,
            "density": density, "seed": seed, "epochs": len(accs), "seconds": 1.0,
            "records": recs}


def test_report_table_gaps_and_verdicts(tmp_path):
    runs = [_run("dense", "dense", 1.0, [90, 98.0], 0), _run("dense", "dense", 1.0, [90, 98.2], 1),
            _run("a", "slim", 0.01, [80, 97.9], 0), _run("a", "slim", 0.01, [80, 98.1], 1),
            _run("b", "slim", 0.001, [80, 97.0], 0),
            dict(_run("b", "slim", 0.001, [80], 1), records=[], diverged="NaN at step 7")]
    rows = report.summarise(runs)
    a = next(r for r in rows if r["config"] == "a")
    assert a["gap"] == pytest.approx(-0.1) and a["seeds"] == 2
    text = report.write_report(runs, str(tmp_path), {0.01: 0.3, 0.001: 0.5})
    assert "| a | 2 | 98.00 ± 0.14 | -0.10 |" in text and "| met |" in text
    # b ran seed 0 only: 97.0 against seed 0's dense, 98.0, misses 0.5 by 0.50
    assert "missed by 0.50" in text and "| b | 1 (+1 diverged) |" in text
    assert (tmp_path / "table.md").exists()


def test_report_gap_is_taken_against_dense_on_the_same_seeds():
    # Dense on 3 seeds (98.0, 98.6, 99.2: mean 98.6), a peer on seed 0 only: its gap is against
    # seed 0's dense (-0.5), not the mean (-1.1); with no seed in common, against the mean.
    runs = [_run("dense", "dense", 1.0, [90, a], s) for s, a in enumerate((98.0, 98.6, 99.2))]
    runs += [_run("a", "slim", 0.01, [80, 97.5], 0), _run("b", "slim", 0.01, [80, 97.5], 7)]
    rows = {r["config"]: r for r in report.summarise(runs)}
    assert rows["a"]["gap"] == pytest.approx(-0.5)
    assert rows["a"]["flushed_gap"] == pytest.approx(-0.5)
    assert rows["b"]["gap"] == pytest.approx(-1.1)


def test_battery_gaps_and_verdicts_are_taken_on_the_same_seeds():
    from benchmarks.convergence import untuned
    case = next(iter(untuned.CASES))

    def run(variant, seed, epoch1, end):
        recs = [{"test_accuracy": a, "steps": 10, "bytes_pushed": 10.0, "bytes_pulled": 10.0,
                 "dense_bytes": 100.0} for a in (epoch1, end)]
        return {"dataset": "mnist", "case": case, "variant": variant,
                "seed": seed, "seconds": 1.0, "records": recs}

    # Dense's seed 1 is far better than its seed 0; the defaults ran seed 0 only.
    rows = untuned.summarise([run("dense", 0, 95.0, 98.0), run("dense", 1, 97.0, 99.0),
                              run("default", 0, 94.5, 97.8)])
    assert untuned.paired_gap(rows[(case, "default")], rows[(case, "dense")],
                              "end") == pytest.approx(-0.2)
    table = untuned.battery_table(rows)
    # Against seed 0's dense: -0.50 after epoch 1 and -0.20 at the end, both met (against the
    # 2-seed means they would read -1.50 and -0.70, both missed).
    assert "| -0.50 |" in table and "| -0.20 |" in table
    assert "epoch 1 met; end met" in table


@pytest.mark.parametrize("via", ["optimizer", "loss"])
def test_fit_applies_the_schedule_through_the_lr_or_the_loss(via):
    """Plain SGD takes the same steps whether the cosine sits in the LR or scales the loss."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(64, 100), torch.randint(0, 2, (64,))
    final = {}
    for how in ("optimizer", via):
        model = _model()
        opt = TopKOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                            1.0, SOLO, min_compress_numel=2 ** 62)  # a plain dense "exchange"
        records = training.fit(SOLO, "topk", model, opt, TensorDataset(x, y), (x, y), epochs=2,
                               batch_size=16, schedule=training.Schedule(0.1, "cosine", via=how),
                               seed=0, show_progress=False)
        final[how] = [p.detach().clone() for p in model.parameters()]
        assert len(records) == 2 and records[-1]["steps"] == 8
        assert (records[-1]["lr"] == 0.1) == (how == "loss")
    for a, b in zip(final["optimizer"], final[via]):
        assert torch.allclose(a, b, atol=1e-6)


# --- the language-model task (benchmarks/convergence/lm.py) -----------------------------------
from benchmarks.convergence import lm  # noqa: E402
from benchmarks.convergence import tasks as common  # noqa: E402


def _tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def test_lm_corpus_is_split_by_path_hash_and_digested(tmp_path):
    files = {f"m{i}.py": f"x = {i}\n" * (i + 1) for i in range(40)}
    files.update({"pkg/inner.py": "import os\n", "test/test_big.py": "skip\n",
                  "notes.txt": "not python\n"})
    _tree(str(tmp_path), files)
    corpus = lm.load_corpus(str(tmp_path))
    kept = [p for p in sorted(files) if p.endswith(".py") and not p.startswith("test/")]
    val = [p for p in kept if lm.is_validation(p)]
    train = [p for p in kept if not lm.is_validation(p)]
    assert corpus.files == (len(train), len(val)) and val and train
    assert corpus.train.numel() == sum(len(files[p]) for p in train)
    assert corpus.val.numel() == sum(len(files[p]) for p in val)
    assert bytes(corpus.train[:len(files[train[0]])].tolist()) == files[train[0]].encode()
    described = corpus.describe()
    assert described["corpus_sha256"] == corpus.digest and len(corpus.digest) == 64
    # The digest names the content: one changed byte anywhere gives another digest.
    _tree(str(tmp_path), {"m3.py": "x = 4\n" * 4})
    assert lm.load_corpus(str(tmp_path)).digest != corpus.digest


def test_dataset_identity_names_the_corpus_only_for_the_language_model():
    assert common.dataset_identity("mnist") == {} == common.dataset_identity("mnist1d")
    ident = common.dataset_identity("pystdlib")["corpus"]
    assert ident["corpus_sha256"] == lm.load_corpus().digest and ident["val_files"] > 0


def test_lm_windows_are_next_byte_pairs():
    data = torch.arange(21, dtype=torch.uint8)
    w = lm.Windows(data, 4)
    assert len(w) == 5
    x, y = w[2]
    assert x.tolist() == [8, 9, 10, 11] and y.tolist() == [9, 10, 11, 12]


def test_byte_lm_is_causal():
    torch.manual_seed(0)
    model = lm.ByteLM(context=16, width=32, layers=2, heads=4).eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])          # no position sees a later byte
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_bits_per_byte_of_a_uniform_model_is_eight():
    class Uniform(torch.nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape, 256)

    one = SimpleNamespace(rank=lambda: 0, size=lambda: 1, Sum="sum",
                          allreduce=lambda t, op: t)
    x = torch.randint(0, 256, (5, 7))
    bpb = lm.evaluate_bpb(one, Uniform(), x, x, batch=2)
    assert bpb == pytest.approx(8.0, rel=1e-6)  # log2(256), up to float32 rounding


# --- the top-k compressor both top-k peers share (benchmarks/topk.py) ------------------------
def test_topk_error_feedback_sends_the_largest_and_keeps_the_rest():
    from benchmarks.topk import TopKErrorFeedback, average
    torch.manual_seed(0)
    ef = TopKErrorFeedback(1000, 0.01)
    grads = [torch.randn(1000) for _ in range(5)]
    sent = torch.zeros(1000)
    for g in grads:
        before = ef.residual.clone() + g
        idx, vals = ef.compress(g)
        assert len(idx) == ef.k == 10 and torch.equal(vals, before[idx])
        # The top-k property: nothing left behind is larger than what was sent.
        assert vals.abs().min() >= ef.residual.abs().max()
        sent.index_add_(0, idx, vals)
    # Conservation: what was sent plus what is held is every gradient, exactly once.
    assert torch.allclose(sent + ef.residual, torch.stack(grads).sum(0), atol=1e-5)
    i, v = torch.tensor([0, 3, 3]), torch.tensor([1.0, 2.0, 4.0])
    assert torch.equal(average([i, i[:1]], [v, v[:1]], 5, 2),
                       torch.tensor([1.0, 0.0, 0.0, 3.0, 0.0]))
    with pytest.raises(ValueError, match="density"):
        TopKErrorFeedback(10, 0)


# --- the untuned battery's report (benchmarks/convergence/untuned.py) ----------------------
def test_lm_table_compares_each_run_with_dense_on_the_same_seeds():
    from benchmarks.convergence import untuned

    def run(variant, seed, bpb):
        rec = {"val_bpb": bpb, "steps": 10, "bytes_pushed": 10.0, "bytes_pulled": 10.0,
               "dense_bytes": 100.0}
        return {"dataset": "pystdlib", "case": "lm", "variant": variant, "seed": seed,
                "seconds": 1.0, "records": [rec]}

    rows = untuned.summarise([run("dense", 0, 2.0), run("dense", 1, 3.0),
                              run("default", 0, 2.5), run("default", 1, 3.3),
                              run("top-k 0.02", 0, 2.2)])
    assert rows[("lm", "dense")]["end"] == 2.5
    table = untuned.lm_table(rows)
    # The 2-seed row against dense's 2-seed mean; the seed-0 peer against seed 0's dense (2.0),
    # not against the mean (which would read -12%).
    assert "| default | 2 | 2.9000 | +16.00% |" in table
    assert "| top-k 0.02 | 1 | 2.2000 | +10.00% |" in table


# --- the local-steps grid's modelled wall time (benchmarks/convergence/local_grid.py) ---------
def test_the_modelled_wire_time_of_a_ring_and_of_a_delayed_round():
    from benchmarks.convergence import local_grid as lg

    rate, lat = lg.RATE_BPS, lg.LATENCY_S
    dense = {"method": "dense", "world_size": 4,
             "records": [{"dense_bytes": 8e6, "steps": 2}]}   # 4 MB a step
    ring = 2 * 3 * lat + 2 * 3 / 4 * 4e6 / rate
    assert abs(lg.wire_seconds(dense, 2, 0, 0) - 2 * ring) < 1e-12
    # hvd_slim at H = 4: 3 pushes into the server, a 2-round tree for the pull, per exchange.
    slim = {"method": "slim", "world_size": 4, "slim": {"local_steps": 4}}
    one = 4 * lat + (3 * 1000 + 2 * 3000) / rate
    assert abs(lg.wire_seconds(slim, 8, 2000, 6000) - 2 * one) < 1e-12
    # outer_delay=1: only what an exchange takes beyond the next round's compute counts.
    late = dict(slim, slim={"local_steps": 4, "outer_delay": 1})
    assert abs(lg.wire_seconds(late, 8, 2000, 6000, compute=0.04) - 2 * (one - 0.16)) < 1e-12
    assert lg.wire_seconds(late, 8, 2000, 6000, compute=1.0) == 0.0
