"""The fair-horizon language-model study (benchmarks/convergence/fair.py): its plan (3 seeds of
dense and the defaults, the peers once), the steps-to-dense's-final measure and its table."""
import pytest

from benchmarks.convergence import fair
from benchmarks.convergence.plan import build_plan


def test_the_plan_runs_the_main_rows_at_every_seed_and_the_peers_once():
    plan = build_plan(["pystdlib"], list(fair.GROUPS), [0, 1, 2], 4)
    by, sgd = {}, {}
    for spec in plan:
        if spec["case"] == fair.BF16_CASE:
            assert spec["param_dtype"] == "bfloat16" and spec["optimizer"] == "adamw"
            sgd.setdefault("bf16 " + spec["variant"], []).append(spec["seed"])
            continue
        if spec["case"] == fair.SGD_CASE:
            # the same transformer and schedule, with SGD and Nesterov momentum
            assert (spec["optimizer"], spec["nesterov"], spec["momentum"]) == ("sgd", True, 0.9)
            sgd.setdefault(spec["variant"], []).append(spec["seed"])
            continue
        by.setdefault(spec["variant"], []).append(spec["seed"])
        if spec["variant"] == fair.LONGER:   # every window, its LR warm-up as asked for 1.25x
            assert spec["train_subset"] == 89491 and spec["lr_warmup_steps"] == 156
            continue
        if spec["variant"] == fair.LONGEST:  # 1.25x the windows: 3,125 steps at 4 ranks of 8
            assert spec["train_subset"] == 100000 and spec["lr_warmup_steps"] == 156
            continue
        assert spec["model"] == "byte-lm-small" and spec["train_subset"] == 80000
        # a cosine over the whole run, its LR warm-up 5% of it
        assert spec["lr_warmup_steps"] == 80000 // (8 * 4) // 20
    assert by == {"dense": [0, 1, 2], "default": [0, 1, 2], "0.001": [0], "0.08": [0], "0.12": [0],
                  "pull union": [0], "pull 0.4": [0], "pull 0.2 at 16 bits": [0],
                  "residual decay 0.95": [0], "push 4 bits": [0],
                  "gradient exchange": [0], "top-k 0.02": [0], "PowerSGD r4": [0],
                  "DiLoCo H=32": [0], fair.LONGER: [0, 1, 2], fair.LONGEST: [0, 1, 2],
                  "local_steps=8": [0],
                  "local_steps=8 dense": [0], "local_steps=8 no decay": [0],
                  "local_steps=8 0.05": [0], "local_steps=8 0.05 no decay": [0],
                  "local_steps=8, senders and settle": [0, 1, 2], "local_steps=4": [0, 1, 2],
                  "local_steps=2": [0, 1, 2],
                  "default, DDP hook": [0, 1, 2],
                  "default, DDP's parameter order": [0, 1, 2],
                  "default, the model's parameter order": [0, 1, 2],
                  "default, exploration seed 1": [0, 1, 2],
                  "update exchange nearly exact (0.5 at 32 bits, pull union)": [0, 1, 2],
                  "0.08, pull 4x": [0, 1, 2], "the defaults' push, pull union": [0, 1, 2],
                  "0.05 at 32 bits, pull union": [0, 1, 2], "0.2, pull 4x": [0, 1, 2],
                  "0.5 at 2 bits, pull union": [0, 1, 2],
                  "sign push, half pulled at 8 bits": [0, 1, 2],
                  "sign push, half pulled at 8 bits, DDP hook": [0, 1, 2],
                  "sign push, all pulled at 8 bits": [0, 1, 2],
                  "sign push, all pulled at 8 bits, DDP hook": [0, 1, 2]}
    assert sgd == {"dense": [0, 1, 2], "default": [0, 1, 2], "pull 4x": [0], "bf16 dense": [0],
                   "bf16 default": [0], "local_steps=4": [0, 1, 2]}
    # the bisection's rows change only what each names
    parts = {s["variant"]: (s["density"], s["slim"]) for s in plan if s["seed"] == 0}
    assert parts["the defaults' push, pull union"] == (None, {"pull": "union"})
    assert parts["0.05 at 32 bits, pull union"] == (None, {"value_bits": 32, "pull": "union"})
    assert parts["0.2, pull 4x"] == (0.2, {})
    assert parts["0.5 at 2 bits, pull union"] == (0.5, {"pull": "union"})
    # the sign push: every coordinate at one bit, the sum pulled half or whole at 8 bits
    sign = {"value_bits": 1, "pull_value_bits": 8}
    assert parts["sign push, half pulled at 8 bits"] == (1.0, dict(sign, pull_density=0.5))
    assert parts["sign push, all pulled at 8 bits"] == (1.0, dict(sign, pull_density=1.0))
    # local steps at their own defaults: only H is given
    assert parts["local_steps=8, senders and settle"] == (None, {"local_steps": 8})
    assert parts["local_steps=4"] == (None, {"local_steps": 4})
    # the defaults pass no Slim-DP keyword at all, through DistributedOptimizer or the DDP hook
    assert [s for s in plan if s["variant"] == "default"][0]["slim"] == {}
    hook = [s for s in plan if s["variant"] == "default, DDP hook"][0]
    assert (hook["method"], hook["slim"], hook["density"]) == ("slim-hook", {}, None)
    assert [s for s in plan if s["variant"] == "default"][0]["density"] is None


def test_steps_to_a_loss_interpolates_between_evaluations():
    curve = [(100, 3.0), (200, 2.5), (300, 2.0)]
    assert fair.steps_to(curve, 2.75) == pytest.approx(150)
    assert fair.steps_to(curve, 2.0) == 300
    assert fair.steps_to(curve, 3.5) == 100
    assert fair.steps_to(curve, 1.9) is None


def _run(variant, seed, curve, pushed, dense_bytes=1000.0, case=fair.CASE):
    *points, (steps, end) = curve
    return {"case": case, "variant": variant, "seed": seed, "seconds": 1.0,
            "loadavg": [1.0, 1.0],
            "records": [{"steps": steps, "val_bpb": end, "bytes_pushed": pushed,
                         "dense_bytes": dense_bytes,
                         "curve": [{"steps": s, "val_bpb": v} for s, v in points]}]}


def test_the_table_gives_the_gap_the_steps_ratio_and_the_bytes():
    runs = [_run("dense", 0, [(100, 3.0), (200, 2.0)], 1000.0),
            _run("default", 0, [(100, 3.0), (200, 2.1), (300, 2.02)], 20.0)]
    rows = fair.summarise(runs)
    assert rows["default"]["end"] == pytest.approx(2.02)
    assert rows["default"]["steps_ratio"] == [None]    # never reached dense's 2.0
    assert rows["default"]["push_ratio"] == pytest.approx(50.0)
    text = fair.table(rows)
    assert rows["default"]["dense_at"] == [pytest.approx(198 / 200)]   # 3.0 -> 2.0 at 2.02
    assert "| default | 1 | 2.0200 | +1.00% | never | 99% of its steps | 50.0x | gap met" in text
    assert "steps missed" in text and "bytes met: 50x" in text


def test_the_gap_to_dense_counts_only_the_seeds_with_a_dense_run():
    """A variant run on more seeds than dense is compared on the seeds they share: seed 1's
    end (without dense) is in its mean but not in its gap."""
    runs = [_run("dense", 0, [(100, 3.0), (200, 2.0)], 1000.0),
            _run("default", 0, [(100, 3.0), (200, 2.04)], 20.0),
            _run("default", 1, [(100, 3.0), (200, 2.5)], 20.0)]
    rows = fair.summarise(runs)
    assert rows["default"]["end"] == pytest.approx(2.27)
    assert rows["default"]["paired_end"] == pytest.approx(2.04)
    assert "| default | 2 (1 with dense) | 2.2700 | +2.00% |" in fair.table(rows)


def test_the_gap_carries_one_standard_error_of_the_per_seed_gaps():
    """Seeds 0-2 end 1%, 3% and 2% above their dense runs: the gaps' mean's standard error is
    their standard deviation (1 point) over the root of 3."""
    runs = []
    for seed, (d, v) in enumerate([(2.0, 2.02), (2.0, 2.06), (2.0, 2.04)]):
        runs += [_run("dense", seed, [(100, 3.0), (200, d)], 1000.0),
                 _run("default", seed, [(100, 3.0), (200, v)], 20.0)]
    rows = fair.summarise(runs)
    assert rows["default"]["gap_se"] == pytest.approx(0.01 / 3 ** 0.5)
    assert rows["dense"]["gap_se"] == 0.0
    text = fair.table(rows)
    assert "| default | 3 | 2.0400 | +2.00% ± 0.58 |" in text
    assert "| dense | 3 | 2.0000 | +0.00% |" in text   # no spread against itself


def test_the_report_compares_each_optimizer_with_its_own_dense(tmp_path):
    runs = [_run("dense", 0, [(100, 3.0), (200, 2.0)], 1000.0),
            _run("default", 0, [(100, 3.0), (200, 2.02)], 20.0),
            _run("dense", 0, [(100, 3.0), (200, 2.5)], 1000.0, case=fair.SGD_CASE),
            _run("default", 0, [(100, 3.0), (200, 2.55)], 25.0, case=fair.SGD_CASE)]
    text = fair.report(runs, str(tmp_path))
    adamw, sgd = text.split("SGD with Nesterov momentum")
    assert "| default | 1 | 2.0200 | +1.00% |" in adamw
    assert "| default | 1 | 2.5500 | +2.00% |" in sgd and "40.0x" in sgd
    assert (tmp_path / "fair.md").read_text() == text


def test_the_steps_verdict_comes_from_the_longer_run_when_there_is_one():
    runs = [_run("dense", 0, [(100, 3.0), (200, 2.0)], 1000.0),
            _run("default", 0, [(100, 3.0), (200, 2.02)], 20.0),
            _run(fair.LONGER, 0, [(100, 3.0), (200, 2.04), (240, 1.98)], 24.0)]
    rows = fair.summarise(runs)
    # dense reached 2.0 at step 200, the longer run at 200 + 40 * 0.04 / 0.06
    assert rows[fair.LONGER]["steps_ratio"] == [pytest.approx((200 + 40 * 2 / 3) / 200)]
    text = fair.table(rows)
    assert "steps met: steps ≤ 1.25x (" + fair.LONGER + ": 1 of 1 seeds reach it)" in text
    runs[-1] = _run(fair.LONGER, 0, [(100, 3.0), (200, 2.04), (240, 2.01)], 24.0)
    assert "steps missed" in fair.table(fair.summarise(runs))


def test_the_longest_run_decides_the_steps_verdict_over_the_longer_one():
    runs = [_run("dense", 0, [(100, 3.0), (200, 2.0)], 1000.0),
            _run("default", 0, [(100, 3.0), (200, 2.02)], 20.0),
            _run(fair.LONGER, 0, [(100, 3.0), (200, 2.04), (224, 2.01)], 24.0),
            _run(fair.LONGEST, 0, [(100, 3.0), (200, 2.04), (250, 1.99)], 24.0)]
    text = fair.table(fair.summarise(runs))
    assert "steps met: steps ≤ 1.25x (" + fair.LONGEST + ": 1 of 1 seeds reach it)" in text
    runs[-1] = _run(fair.LONGEST, 0, [(100, 3.0), (200, 2.04), (250, 2.005)], 24.0)
    assert "steps missed: steps ≤ 1.25x (" + fair.LONGEST + ": 0 of 1" in fair.table(
        fair.summarise(runs))


def test_a_subset_beyond_the_corpus_sees_every_window_then_a_seeded_draw_again():
    from benchmarks.convergence import tasks
    n = len(tasks.load_dataset("pystdlib")[0])
    once, _ = tasks.load_dataset("pystdlib", n)
    assert once.indices == list(range(n))
    more, _ = tasks.load_dataset("pystdlib", n + 500, data_seed=3)
    assert more.indices[:n] == list(range(n))
    again = more.indices[n:]
    assert len(again) == len(set(again)) == 500 and all(0 <= i < n for i in again)
    assert tasks.load_dataset("pystdlib", n + 500, data_seed=3)[0].indices == more.indices
    assert tasks.load_dataset("pystdlib", n + 500, data_seed=4)[0].indices[n:] != again


@pytest.mark.parametrize("reverse", [True, False], ids=["reversed", "the model's"])
def test_ddps_parameter_order_reaches_the_optimizer_by_name(reverse):
    """The study's probe of the flat buffer's order: renamed so that hvd_slim's name order
    (it sorts by name) is the model's order, or that reversed, the same tensors."""
    import torch
    from benchmarks.convergence.training import ordered_names
    named = [(f"layer{i}.weight", torch.zeros(1)) for i in (0, 1, 10, 2)]
    renamed = ordered_names(named, reverse=reverse)
    want = list(reversed(named)) if reverse else named
    assert [p for _, p in sorted(renamed, key=lambda np: np[0])] == [p for _, p in want]
    assert all(new.endswith(old) for (new, _), (old, _) in zip(renamed, named))
