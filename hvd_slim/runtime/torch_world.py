"""hvd_slim's runtime over torch.distributed, for a job started by an ``env://`` launcher:
torchrun (alone, under srun, or in a Kubeflow PyTorchJob), which sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. No MPI is involved: mpi4py is never imported.

:func:`start` (under ``hvd.init()``, runtime/basics.py) joins the launcher's key-value store
(``env://``: torchrun's own store, or one rank 0 opens), has every rank register in it so that
a duplicated or missing rank or disagreeing world sizes end in the same clear error on every
rank within ``HVD_SLIM_TRANSPORT_TIMEOUT`` seconds, initialises torch.distributed's default
group when the script has not (Gloo, plus NCCL for CUDA tensors where torch has it and sees a
GPU), and makes the tensor API a Gloo group of its own, so the script's own torch.distributed
calls never meet hvd_slim's. The optimizer's Gloo and NCCL transports are made on that default
group (optim/rendezvous.py). Local and cross ranks come from the hosts, named as everywhere in
hvd_slim (runtime/hosts.py): ``HVD_SLIM_HOST_KEY`` where set, else the host name.

An uncaught exception ends the job through :mod:`hvd_slim.runtime.abort`, which leaves with
status 1 after writing why to the store; torchrun then stops the other ranks.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..transport.torch_api import ABORT_KEY, TorchCollectives
from ..transport.torch_dist import TorchDistTransport, summary
from . import abort, env
from .groups import SetGroups, outside
from .hosts import HOST_KEY_VAR, Placement, host_colors

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# An MPI launcher's rank variables: their presence means mpirun (or srun's PMI) started this
# process, whatever else is set.
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
TIMEOUT_ENV = "HVD_SLIM_TRANSPORT_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# The tensor API's groups wait as long as hvd_slim's own deadline (HVD_SLIM_TIMEOUT, which may
# be "forever") lets them: Gloo's own limit is only a backstop.
API_GROUP_TIMEOUT = datetime.timedelta(days=7)
_generation = 0   # starts of this runtime, the same count on every rank: the store's key prefix


def timeout(environ: Optional[Mapping[str, str]] = None) -> datetime.timedelta:
    """The process-group and rendezvous timeout, from ``HVD_SLIM_TRANSPORT_TIMEOUT`` (seconds)."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV)
    if raw is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"environment variable {TIMEOUT_ENV}={raw!r} must be a number of seconds > 0")
    return datetime.timedelta(seconds=value)


def torchrun_env(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """``(rank, size)`` from torchrun's variables, or None when none is set. Raises ValueError when
    some are missing, out of range, or disagree with another launcher's variables."""
    environ = os.environ if environ is None else environ
    present = [v for v in TORCHRUN_VARS if v in environ]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in environ]
    if missing:
        raise ValueError(f"torchrun-style launch: {', '.join(present)} set but {', '.join(missing)} "
                         f"not; launch with torchrun, or under mpirun/horovodrun unset them")
    if "TORCHELASTIC_RUN_ID" in environ:   # torchrun's own worker: its RANK is the truth, even
        environ = {v: environ[v] for v in TORCHRUN_VARS}   # where srun's PMI variables leak in
    announced = env.env_rank_size(environ)  # checks ints, range, agreement with other launchers
    assert announced is not None
    return announced[0], announced[1]


def launched_by_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``hvd.init()`` should run on torch.distributed: torchrun's variables are set
    (any of them: an incomplete set is then reported by :func:`torchrun_env`) and either
    torchrun itself started this process or no MPI launcher did."""
    environ = os.environ if environ is None else environ
    if not any(v in environ for v in TORCHRUN_VARS):
        return False
    return "TORCHELASTIC_RUN_ID" in environ or not any(v in environ for v in MPI_RANK_VARS)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


_env_store: Any = None


def env_store(tmo: datetime.timedelta) -> Any:
    """The ``env://`` store (torchrun's, or one rank 0 opens at MASTER_ADDR:MASTER_PORT),
    joined once per process: rank 0 cannot open a second one on the same port."""
    global _env_store
    if _env_store is not None:
        return _env_store
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        _env_store, _, _ = next(dist.rendezvous("env://", timeout=tmo))
    except Exception as exc:  # noqa: BLE001 - re-raised with the address and the likely cause
        raise RuntimeError(f"hvd_slim rendezvous: the env:// store at {where} failed: "
                           f"{first_line(exc)} (RANK={os.environ.get('RANK')}, WORLD_SIZE="
                           f"{os.environ.get('WORLD_SIZE')}); is the port free, is exactly one "
                           f"process rank 0, and are all WORLD_SIZE ranks started?") from None
    return _env_store


def register(store: Any, rank: int, size: int, tmo: datetime.timedelta) -> None:
    """Every rank checks in; raises the same clear error everywhere on duplicated or missing
    ranks or disagreeing world sizes."""
    def fail(msg: str) -> None:
        store.set("error", msg)
        raise RuntimeError(msg)

    first = store.compare_set("size", "", str(size)).decode()
    if first != str(size):
        fail(f"hvd_slim rendezvous: rank {rank} was launched for a world of {size} ranks but "
             f"another rank for {first}; the launcher's ranks are inconsistent")
    if store.add(f"rank/{rank}", 1) != 1:
        fail(f"hvd_slim rendezvous: two processes claim rank {rank} of {size}; the launcher's "
             f"ranks are inconsistent (check RANK / OMPI_COMM_WORLD_RANK)")
    store.add("joined", 1)
    deadline = time.monotonic() + tmo.total_seconds()
    while True:
        if store.check(["error"]):
            raise RuntimeError(store.get("error").decode())
        if store.add("joined", 0) >= size:
            return
        if time.monotonic() > deadline:
            missing: List[int] = [r for r in range(size) if not store.check([f"rank/{r}"])]
            raise RuntimeError(f"hvd_slim rendezvous: only {size - len(missing)} of {size} ranks "
                               f"joined within {tmo.total_seconds():g} s; missing ranks {missing}. "
                               f"Start every rank, or check the launcher's RANK/WORLD_SIZE")
        time.sleep(0.02)


def check_default_group(who: str, rank: int, size: int, launcher: str, ranks: str) -> None:
    """Raise RuntimeError, for ``who`` (the call that joins the job), when the default group the
    script initialised puts this process elsewhere than rank ``rank`` of ``size``, as
    ``launcher`` says; the message advises initialising it over ``ranks``."""
    theirs = (dist.get_rank(), dist.get_world_size())
    if theirs != (rank, size):
        raise RuntimeError(
            f"{who}: torch.distributed is already initialised as rank {theirs[0]} of {theirs[1]} "
            f"but {launcher} says rank {rank} of {size}; initialise torch.distributed over "
            f"{ranks}, or leave it to hvd_slim")


@dataclass
class TorchWorld(Placement):
    """The running job on torch.distributed, as runtime/basics.py holds it: this rank's
    placement (first, in its field order), then what runs it."""
    api: TorchCollectives
    store: Any                      # the job's keys (roll calls, the abort note), or None
    owns_default: bool              # hvd_slim initialised the default group: it destroys it
    timeout: datetime.timedelta
    groups: List[Any] = field(default_factory=list)   # made here, destroyed at close
    closed: bool = False

    def subgroup(self, ranks: List[int], set_id: int) -> SetGroups:
        """Collective over the job: the groups of the process set ``ranks`` (sorted job
        ranks), every rank making every group in the same order, as torch requires."""
        api_group = dist.new_group(ranks, timeout=API_GROUP_TIMEOUT, backend="gloo")
        exchange_group = dist.new_group(ranks, timeout=self.timeout, backend="gloo")
        if self.rank not in ranks:
            return outside()
        me, n = ranks.index(self.rank), len(ranks)
        made: List[Any] = []

        def make_transport() -> Any:
            if not made:
                made.append(TorchDistTransport(exchange_group, "gloo", torch.device("cpu"), me, n,
                                               self.timeout))
            return made[0]

        def release() -> None:
            if made:
                made[0].close()
            for g in (exchange_group, api_group):
                destroy_group(g)
        return SetGroups(TorchCollectives(api_group, me, n, self.store, f"set{set_id}"),
                         make_transport, release)

    def close(self) -> None:
        """Destroy the groups made here (the default group last, if hvd_slim made it)."""
        if self.closed:
            return
        self.closed = True
        abort.forget_launcher_world()
        for g in reversed(self.groups):
            destroy_group(g)
        if self.owns_default and dist.is_initialized():
            destroy_group(None)


def destroy_group(group: Any) -> None:
    """Destroy ``group`` (None: the default one, and every other with it), and nothing when
    it is gone already: a script's ``destroy_process_group()`` takes every group."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - teardown must go on (the group may be gone already)
        pass


def _note(store: Any) -> Callable[[str], None]:
    """Write a failed rank's message where the others look (the first failure's stays)."""
    def note(text: str) -> None:
        store.compare_set(ABORT_KEY, "", text)
    return note


def _host_ranks(api: TorchCollectives, rank: int) -> Tuple[int, int, int, int]:
    """``(local_rank, local_size, cross_rank, cross_size)`` from every rank's host, gathered
    over ``api`` (collective)."""
    mine = f"{os.environ.get(HOST_KEY_VAR, '')}\n{socket.gethostname()}"
    got = [b.tobytes().decode("utf-8", "replace").split("\n", 1)
           for b in api.allgather_bytes(np.frombuffer(mine.encode("utf-8"), np.uint8))]
    colors = host_colors([k if k else None for k, _ in got])   # same error on every rank
    if colors is None:
        first: Dict[str, int] = {}
        colors = [first.setdefault(h, len(first)) for _, h in got]
    # Each rank's position on its host, in rank order; ranks with the same position form a
    # cross group (one rank per host).
    on_host: Dict[int, int] = {}
    local = []
    for c in colors:
        local.append(on_host.get(c, 0))
        on_host[c] = local[-1] + 1
    cross = [q for q, lr in enumerate(local) if lr == local[rank]]
    return local[rank], colors.count(colors[rank]), cross.index(rank), len(cross)


def start() -> TorchWorld:
    """Start the job's runtime on torch.distributed (collective over every rank; see the
    module). Raises ValueError for incomplete or inconsistent launcher variables and
    RuntimeError when the ranks cannot meet or torch.distributed disagrees with them."""
    global _generation
    rank, size = torchrun_env()   # type: ignore[misc]   # launched_by_env() said it is set
    tmo = timeout()
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("hvd_slim.init() under torchrun runs on torch.distributed's Gloo, which "
                           "this torch build lacks; install a torch with distributed support")
    _generation += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hvd_slim/runtime/{restart}/{_generation}/"
    if dist.is_initialized():
        check_default_group("hvd_slim.init()", rank, size, "the launcher (RANK/WORLD_SIZE)",
                            "the launcher's ranks")
        base, owns = _default_store(), False
    else:
        base = env_store(tmo)
        register(dist.PrefixStore(prefix + "join/", base), rank, size, tmo)
        backend = "gloo"
        if dist.is_nccl_available() and torch.cuda.is_available():
            backend = "cpu:gloo,cuda:nccl"   # the script's own CUDA collectives get NCCL
        try:
            dist.init_process_group(backend, store=dist.PrefixStore(prefix + "default/", base),
                                    rank=rank, world_size=size, timeout=tmo)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the rank and the limit
            raise RuntimeError(f"hvd_slim.init(): rank {rank} of {size} could not start "
                               f"torch.distributed ({backend}) within {tmo.total_seconds():g} s "
                               f"({TIMEOUT_ENV}): {summary(exc)}") from None
        owns = True
    store = None if base is None else dist.PrefixStore(prefix + "api/", base)
    abort.use_launcher_world(rank, size, _note(store) if store is not None else lambda text: None)
    world = TorchWorld(rank, size, 0, 1, 0, 1, None, store, owns, tmo)   # type: ignore[arg-type]
    try:
        group = dist.new_group(timeout=API_GROUP_TIMEOUT, backend="gloo")
        world.groups.append(group)
        world.api = TorchCollectives(group, rank, size, store, "job")
        with world.api.watch(tmo.total_seconds(), "hvd_slim.init()"):
            world.local_rank, world.local_size, world.cross_rank, world.cross_size = \
                _host_ranks(world.api, rank)
    except BaseException:
        world.close()   # a later init() starts afresh
        raise
    _close_at_exit(world)
    return world


def _default_store() -> Any:
    """The store of a default group the script made itself (None where torch hides it: the
    roll call and abort notes are then left out)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private function of torch: may change or be absent
        return None


def _close_at_exit(world: TorchWorld) -> None:
    """Destroy the groups at exit if ``shutdown`` did not, before interpreter teardown."""
    atexit.register(world.close)
