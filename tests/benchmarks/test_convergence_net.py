"""Single-process tests of the convergence study's ``--net`` option and of the time-to-accuracy
report: the plan and its jobs, the mpirun options, benchmarks.convergence.train's spec flags, the timing
of ``training.fit`` and the tables. Nothing here needs a network namespace or MPI."""
from __future__ import annotations

import dataclasses

import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import launch, netem
from benchmarks.convergence import plan as conv
from benchmarks.convergence import report, study
from benchmarks.convergence import time_to_accuracy as tta
from benchmarks.convergence import train as mnist
from benchmarks.convergence import training
from benchmarks.convergence.topk import TopKOptimizer


def test_plan_on_an_emulated_network_has_its_own_keys():
    loop = conv.build_plan(["mnist"], ["longer"], [0, 1], 4)
    shaped = conv.build_plan(["mnist"], ["longer"], [0, 1], 4, "tbf1g")
    # Loopback keys are the study's old ones (results resume); shaped ones never collide.
    assert loop[0]["key"] == "mnist/dense 4-epochs/seed0" and loop[0]["net"] == "loopback"
    assert [s["key"] for s in shaped] == [s["key"] + "@tbf1g" for s in loop]
    assert {s["net"] for s in shaped} == {"tbf1g"}
    with pytest.raises(ValueError, match="net"):
        conv.build_plan(["mnist"], ["longer"], [0], 4, "wifi")


def test_time_group_is_the_four_configs_interleaved_by_seed():
    plan = conv.build_plan(["mnist"], ["time"], [0, 1, 2], 4, "tbf1g")
    assert len(plan) == 12 and {s["epochs"] for s in plan} == {4}
    assert {s["evals_per_epoch"] for s in plan} == {2}  # an evaluation every half epoch
    assert [s["seed"] for s in plan] == [0] * 4 + [1] * 4 + [2] * 4
    assert [s["method"] for s in plan[:4]] == ["dense", "horovod", "slim", "slim"]
    slim = {s["density"]: s["slim"] for s in plan if s["method"] == "slim"}
    assert slim == {0.01: {}, 0.001: {"pull_density": 0.004}}  # the 4x pull, explicit


def test_segments_run_horovod_alone_and_keep_plan_order():
    plan = conv.build_plan(["mnist"], ["time"], [0, 1], 4, "tbf1g")
    segs = conv.segments(plan)
    assert [(kind, len(part)) for kind, part in segs] == [
        ("sweep", 1), ("horovod", 1), ("sweep", 3), ("horovod", 1), ("sweep", 2)]
    assert [s["key"] for _, part in segs for s in part] == [s["key"] for s in plan]
    two = conv.build_plan(["mnist1d", "mnist"], ["longer"], [0], 4)
    assert [part[0]["dataset"] for _, part in conv.segments(two)] == ["mnist", "mnist1d"]


def test_emulated_network_takes_mpi_over_tcp_on_lo():
    assert netem.mpi_args("loopback") == []
    args = netem.mpi_args("tbf1g")
    assert args[args.index("btl") + 1] == "tcp,self"  # no shared memory past the shaping
    assert args[args.index("btl_tcp_if_include") + 1] == "lo"
    argv = launch.mpirun_argv(4, ["python", "x.py"], (*launch.NO_SINGLE_COPY, *args))
    assert argv[-2:] == ["python", "x.py"] and "tcp,self" in argv[:argv.index("python")]
    assert "btl_vader_single_copy_mechanism" in launch.mpirun_argv(4, ["x"])  # the default


def test_mnist_runs_a_horovod_spec_with_the_same_settings():
    spec = conv.build_plan(["mnist"], ["time"], [2], 4, "tbf1g")[1]
    args = mnist.build_parser().parse_args(mnist.spec_argv(spec, "/tmp/x.json"))
    assert (args.method, args.epochs, args.batch_size, args.lr, args.lr_schedule, args.seed,
            args.evals_per_epoch, args.json) == ("horovod", 4, 64, 0.05, "cosine", 2, 2,
                                                 "/tmp/x.json")
    slim = dict(spec, method="slim", density=0.001,
                slim={"pull_density": 0.004, "momentum_correction": False,
                      "momentum_masking": False, "warmup_dense_steps": 23,
                      "warmup_decay_steps": 47})
    args = mnist.build_parser().parse_args(mnist.spec_argv(slim, "o.json"))
    assert mnist.slim_kwargs(args) == {"pull_density": 0.004, "momentum_correction": False,
                                       "momentum_masking": False, "warmup_dense_steps": 23,
                                       "warmup_decay_steps": 47}
    half = dict(slim, slim={"momentum_masking": 0.5})
    args = mnist.build_parser().parse_args(mnist.spec_argv(half, "o.json"))
    assert mnist.slim_kwargs(args) == {"momentum_masking": 0.5}
    adam = dict(slim, optimizer="adam", slim={"adam_variance": "live"})
    args = mnist.build_parser().parse_args(mnist.spec_argv(adam, "o.json"))
    assert args.optimizer == "adam" and mnist.slim_kwargs(args) == {"adam_variance": "live"}
    with pytest.raises(ValueError, match="sweep"):
        mnist.spec_argv(dict(spec, lr_via="loss"), "o.json")
    line = mnist.spec_result(spec, {"world_size": 4, "seconds": 9.0, "epochs": [{"epoch": 1}]})
    assert line["key"] == spec["key"] and line["records"] == [{"epoch": 1}]


SOLO = SimpleNamespace(size=lambda: 1, rank=lambda: 0, Average=0, Sum=1,
                       allgather=lambda t: t.clone(), allreduce=lambda t, op=None: t.clone())


def test_fit_times_training_without_the_evaluations():
    from torch.utils.data import TensorDataset

    pause = 1.0

    def slow_evaluate(hvd, model, x, y):
        time.sleep(pause)
        return 50.0

    task = dataclasses.replace(training.CLASSIFICATION, score=slow_evaluate)
    torch.manual_seed(0)
    x, y = torch.randn(64, 10), torch.randint(0, 2, (64,))
    model = torch.nn.Linear(10, 2)
    opt = TopKOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                        1.0, SOLO, min_compress_numel=2 ** 62)
    records = training.fit(SOLO, "topk", model, opt, TensorDataset(x, y), (x, y), epochs=2,
                           batch_size=16, schedule=training.Schedule(0.1), seed=0,
                           show_progress=False, evals_per_epoch=2, task=task)
    points = tta.points({"records": records})
    assert [p["epoch"] for p in points] == [0.5, 1, 1.5, 2]
    walls = [p["wall_seconds"] for p in points]
    # 8 tiny steps and no evaluation in the wall time: counting the 4 evaluations would put it
    # at 4 x pause or more, whatever the machine's load does to the steps.
    assert walls == sorted(walls) and walls[-1] < 3 * pause
    # Every evaluation is accounted for apart: 4 of them by the end of epoch 2.
    assert [round(p["eval_seconds"] / pause) for p in points] == [1, 2, 3, 4]


def _timed_run(config, method, seed, accs, net="tbf1g", step_s=10.0):
    """A fake timed run: one evaluation every half epoch, ``accs`` at each."""
    pts = [{"epoch": (i + 1) / 2, "steps": 100 * (i + 1), "test_accuracy": a,
            "wall_seconds": step_s * (i + 1), "eval_seconds": 1.0 * (i + 1),
            "bytes_pushed": 1e6 * (i + 1), "bytes_pulled": 2e6 * (i + 1),
            "dense_bytes": 1e7 * (i + 1)} for i, a in enumerate(accs)]
    records = [dict(pts[i + 1], curve=[pts[i]]) for i in range(0, len(pts), 2)]
    records[-1]["flushed_accuracy"] = accs[-1]
    return {"key": f"mnist/{config}/seed{seed}@{net}", "dataset": "mnist", "group": "time",
            "config": config, "method": method, "density": 1.0 if method != "slim" else 0.01,
            "seed": seed, "epochs": len(accs) // 2, "seconds": 1.0, "net": net,
            "network": {"net": net, "pingpong": {"gbit_per_s": 0.97}}, "records": records}


def test_reached_is_the_first_evaluation_at_or_above_the_target():
    run = _timed_run("dense", "dense", 0, [97.0, 98.5, 98.2, 99.0])
    hit = tta.reached(run, 98.5)
    assert hit == {"seconds": 20.0, "epoch": 1.0, "steps": 200.0, "eval_seconds": 2.0,
                   "bytes_pushed": 2e6, "bytes_pulled": 4e6}
    assert tta.reached(run, 98.6)["epoch"] == 2.0  # 98.2 at 1.5 does not count
    assert tta.reached(run, 99.5) is None
    assert tta.timed(run)
    del run["records"][0]["curve"][0]["wall_seconds"]  # an old, untimed run
    assert not tta.timed(run)


def test_time_to_accuracy_table(tmp_path):
    runs = [_timed_run("dense", "dense", s, [98.0, 98.6, 98.9, 99.0], step_s=10.0)
            for s in (0, 1)]
    runs += [dict(_timed_run("slim", "slim", 0, [97.0, 98.0, 98.5, 98.7], step_s=5.0),
                  loadavg=[4.0, 9.0]),
             dict(_timed_run("slim", "slim", 1, [97.0, 98.0, 98.2, 98.9], step_s=5.0),
                  loadavg=[6.0, 1.0]),
             _timed_run("horovod", "horovod", 0, [98.0, 98.0, 98.0, 98.1])]
    rows = {r["config"]: r for r in tta.summarise(runs, {"mnist": 98.5})}
    assert rows["dense"]["reached"] == 2 and rows["dense"]["seconds"] == pytest.approx(20.0)
    slim = rows["slim"]
    assert slim["reached"] == 2 and slim["seconds"] == pytest.approx(17.5)  # 15 and 20 s
    assert slim["epoch"] == pytest.approx(1.75) and slim["bytes_pushed"] == pytest.approx(3.5e6)
    assert slim["vs_dense"] == pytest.approx(20.0 / 17.5)
    assert rows["horovod"]["reached"] == 0 and "seconds" not in rows["horovod"]
    text = report.write_report(runs, str(tmp_path), {0.01: 0.3}, {"mnist": 98.5})
    assert "**Time to 98.5% on tbf1g**" in text and "measured 0.97 Gbit/s" in text
    row = "| slim | 2/2 | 18 ± 4 | 1.14x | 1.75 ± 0.35 | 3.5 | 7.0 | 4 | 20 | 98.80 | 5.0 |"
    assert row in text
    assert "| horovod | 0/1 | not reached |" in text
    assert (tmp_path / "mnist_accuracy_vs_seconds_tbf1g.png").exists()
    assert "Time to" not in report.write_report(runs, str(tmp_path), {0.01: 0.3})


def test_report_keeps_networks_apart():
    loop = [_timed_run("dense", "dense", 0, [98.0, 99.0], net="loopback"),
            _timed_run("slim", "slim", 0, [98.0, 98.0], net="loopback")]
    loop[1].pop("net")  # a run from before --net: loopback
    shaped = [_timed_run("dense", "dense", 0, [98.0, 98.5]),
              _timed_run("slim", "slim", 0, [98.0, 98.4])]
    rows = {r["label"]: r for r in report.summarise(loop + shaped)}
    assert set(rows) == {"dense", "slim", "dense @tbf1g", "slim @tbf1g"}
    assert rows["slim"]["gap"] == pytest.approx(-1.0)  # against loopback dense
    assert rows["slim @tbf1g"]["gap"] == pytest.approx(-0.1)  # against dense on tbf1g


def test_report_only_writes_the_time_table(tmp_path, monkeypatch):
    runs = [_timed_run("dense 4-epochs", "dense", 0, [98.0, 98.6, 98.9, 99.0])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--report-only", "--net", "tbf1g",
                                      "--out", str(tmp_path)])
    study.main()
    assert "Time to 98.5% on tbf1g" in (tmp_path / "table.md").read_text()
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--net", "wifi"])
    with pytest.raises(SystemExit):
        study.main()


def test_a_rerun_of_some_rows_keeps_the_rest_of_table_md(tmp_path, monkeypatch):
    # The results file holds dense and a slim row; rerunning only dense (--only) must rewrite
    # table.md with both, not with dense alone.
    def run(config, method, acc):
        r = _timed_run(config, method, 0, [acc - 1, acc], net="loopback")
        return dict(r, key=f"mnist1d/{config}/seed0", dataset="mnist1d", group="grid")
    runs = [run("dense", "dense", 72.0), run("slim d=0.01 pull=slim expl=0", "slim", 71.5)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(study, "launch", lambda *a, **k: None)   # the "rerun" changes nothing
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--preset", "quick", "--groups", "grid",
                                      "--only", "^dense$", "--out", str(tmp_path)])
    study.main()
    table = (tmp_path / "table.md").read_text()
    assert "| dense | 1 |" in table and "| slim d=0.01 pull=slim expl=0 | 1 |" in table
