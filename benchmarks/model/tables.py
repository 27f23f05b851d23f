"""The Markdown of :mod:`.validate`: one table per results file, predicted beside measured."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from .scenario import Scenario

if TYPE_CHECKING:   # pragma: no cover
    from .validate import Row

LEGEND_CALIBRATED = (
    "compute + local: (m) this file's floor (the compute input) plus what the peer adds to the "
    "floor on the calibration run (its median minus the model's communication on its network "
    "and minus its floor), times the load index; (d) derived as "
    "without --local-from (the floor's median here, measured, plus the counted passes at the "
    "floor's cost per element and the measured selection). comm from the model on this file's "
    "network.")
LEGEND_DERIVED = (
    "(m) measured input; local = the measured selection (m) plus the streaming passes and "
    "scatters the model counts for the strategy (derived pass cost); comm from the model.")
LEGEND_BYTES = (
    " Bytes: `*` the benchmark's figure is itself derived (a ring/allgather formula on counted "
    "buffers), others counted; hvd_slim's are the transport's push and pull sizes.")


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _bytes(measured: Optional[float], predicted: float, derived: bool) -> str:
    if measured is None:
        return f"- / {_mb(predicted)}"
    return f"{_mb(measured)}{'*' if derived else ''} / {_mb(predicted)}"


def _local_cells(r: "Row") -> Tuple[str, str]:
    """(compute + local, where it comes from) for the calibrated table."""
    p = r.pred
    if r.calib is not None and r.overlapped:
        load = f" x load {r.load:.3f}" if r.load != 1.0 else ""
        return (f"{r.floors[0] + r.local_m * r.load:.4f} (m)",
                f"floor {r.floors[0]:.4f} + max((calibration {r.calib[0]:.4f} - its floor "
                f"{r.floors[1]:.4f}){load}, comm): overlapped, the wire ends "
                f"{p.detail['wire_end_s']:.4f} s after the step's start, backward() at "
                f"{p.detail['backward_end_s']:.4f}")
    if r.calib is not None:
        load = f" x load {r.load:.3f}" if r.load != 1.0 else ""
        return (f"{r.floors[0] + r.local_m * r.load:.4f} (m)",
                f"floor {r.floors[0]:.4f} + (calibration {r.calib[0]:.4f} - its comm "
                f"{r.calib[1]:.4f} - its floor {r.floors[1]:.4f}){load}")
    sel = p.detail.get("select_s")
    return (f"{p.compute_s + p.local_s:.4f} (d)",
            f"compute {p.compute_s:.4f} (m) + local {p.local_s:.4f}" +
            (f" (select {sel:.4f} m)" if sel else ""))


def table(rows: Sequence["Row"], calibrated: bool = False) -> str:
    """The Markdown table of one file's rows (``calibrated``: the --local-from columns)."""
    mid = ("compute + local | from | " if calibrated else "compute (m) | local | ")
    head = ("| peer | measured s/step | predicted s/step | error | " + mid +
            "comm (model) | sent/rank MB meas/pred | recv/rank MB meas/pred | "
            "busiest NIC tx MB meas/pred | busiest NIC rx MB meas/pred |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        p, rec = r.pred, r.peer_rec
        derived = (rec.get("basis") or {}).get("wire") == "derived"
        nic = rec.get("nic_bytes_per_step") or {}
        if calibrated:
            cells = " | ".join(_local_cells(r))
        else:
            sel = p.detail.get("select_s")
            cells = f"{p.compute_s:.4f} | {p.local_s:.4f}" + \
                (f" (select {sel:.4f} m)" if sel else "")
        lines.append(
            f"| {r.peer} | {r.measured:.4f} | {r.seconds:.4f} | {100 * r.error:+.1f}% | "
            f"{cells} | {p.comm_s:.4f} | "
            f"{_bytes(rec.get('bytes_sent_per_step'), p.sent_per_rank, derived)} | "
            f"{_bytes(rec.get('bytes_recv_per_step'), p.recv_per_rank, derived)} | "
            f"{_bytes(nic.get('busiest_tx'), p.busiest_tx, False)} | "
            f"{_bytes(nic.get('busiest_rx'), p.busiest_rx, False)} |")
    return "\n".join(lines)


def net_words(sc: Scenario) -> str:
    return (f"{sc.ranks} ranks, {sc.net.topology} at "
            f"{', '.join(f'{r / 1e9:g}' for r in sc.net.rate_bps)} Gbit/s")
