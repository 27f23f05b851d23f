"""Up-front validation of ``DistributedOptimizer``'s arguments, and what they resolve to."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..api import process_sets as sets
from ..api.collectives import Adasum, Average, Sum
from ..api.compression import Compression
from ..config import ENV_KEYWORDS, ENV_PREFIX, SlimConfig
from ..config.env import resolve_config
from ..exchange.layout import Layout
from ..outer import check_outer_optimizer, describe_outer_optimizer
from ..runtime import basics
from ..transport.base import Transport
from .transport_choice import resolve

SLIM_KEYWORDS = set(ENV_KEYWORDS) | {"transport", "outer_optimizer"}


@dataclass(frozen=True)
class SlimSettings:
    config: SlimConfig
    named_parameters: List[Tuple[str, torch.Tensor]]
    compression: Any
    transport: Optional[Transport]   # None on a rank outside the process set
    ranks: Optional[List[int]] = None   # the process set's job ranks; None: the whole job
    outer: Any = None   # local_steps > 1: the outer optimizer given (None: DiLoCo's default)

    @property
    def included(self) -> bool:
        """Whether this rank takes part in the exchange (it is in the process set)."""
        return self.transport is not None


def checked_named(named_parameters: Iterable) -> List[Tuple[str, torch.Tensor]]:
    """Horovod's checks of ``named_parameters``: ``(name, tensor)`` tuples with unique string
    names. Returns them as a list."""
    named = list(named_parameters)
    bad = [x for x in named if not (isinstance(x, tuple) and len(x) == 2)]
    if bad:
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         f"usually produced by model.named_parameters(); got {type(bad[0])}")
    seen, dups = set(), set()
    for name, p in named:
        if not isinstance(name, str):
            raise ValueError(f"named_parameters: names must be strings, got {name!r}")
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"named_parameters: {name!r} names a {type(p).__name__}, not a "
                             f"tensor; pass model.named_parameters()")
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(dups)))
    return named


def named_parameter_list(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable]) -> List[Tuple[str, torch.Tensor]]:
    """Horovod's checks: tuples, unique names, every optimizer parameter named. Returns the
    (name, param) pairs of the optimizer's parameters."""
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"noname.{gi}.{i}", p) for gi, g in enumerate(optimizer.param_groups)
                for i, p in enumerate(g["params"])]
    by_id = {id(p): n for n, p in checked_named(named_parameters)}
    unnamed = [p for p in opt_params if id(p) not in by_id]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named ({len(unnamed)} of shapes {shapes}). Pass "
                         "model.named_parameters() of the model whose parameters the optimizer "
                         "holds")
    return [(by_id[id(p)], p) for p in opt_params]


def comm_dtype_fn(compression: Any) -> Callable[[torch.dtype], torch.dtype]:
    """Map a bucket dtype to the dtype its values travel in, by probing the compressor
    (``Compression.none`` keeps it, ``Compression.fp16`` halves floats)."""
    def comm_dtype(dtype: torch.dtype) -> torch.dtype:
        probe = torch.zeros(2, dtype=dtype)
        out, ctx = compression.compress(probe)
        if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
            raise ValueError(f"compression {compression!r} changes the tensor's shape; hvd_slim "
                             "supports dtype-casting compressors only (Compression.none, "
                             "Compression.fp16)")
        return out.dtype
    return comm_dtype


def _check_horovod_args(backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                        groups) -> str:

    if op is None or op == Adasum:   # Adasum: refused once the density is known
        op = Average
    if op not in (Average, Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an integer >= 0, got {num_groups!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
    if groups is not None and not (isinstance(groups, int) and not isinstance(groups, bool)
                                   and groups > 0) and not isinstance(groups, (list, tuple)):
        raise ValueError(f"groups must be a positive int or a list of lists of parameters, got "
                         f"{groups!r}")
    return "average" if op == Average else "sum"


def _adasum_refusal(config: SlimConfig) -> str:
    """Why op=hvd.Adasum is refused, and what to pass instead, at the density in force."""
    supported = "use op=hvd.Average (the default) or op=hvd.Sum"
    if config.density < 1.0:
        return (f"op=hvd.Adasum is not supported by hvd_slim's DistributedOptimizer: Adasum is a "
                f"dense reduction, and a sparse exchange (density={config.density:g}"
                f"{config.env_note('density')}) cannot carry it; {supported}. density=1.0 "
                "gives an exact dense exchange, but it averages or sums too: Adasum is not "
                "implemented at any density")
    return ("op=hvd.Adasum is not supported by hvd_slim, also at density=1.0: its dense exchange "
            f"(and hvd.allreduce) only average or sum; {supported}")


def resolve_settings(named, compression, backward_passes_per_step, op, gradient_predivide_factor,
                     num_groups, groups, sparse_as_dense, process_set,
                     slim_kwargs: Dict[str, Any]) -> SlimSettings:
    """Validate everything before any state is built; errors name the argument."""
    unknown = set(slim_kwargs) - SLIM_KEYWORDS
    if unknown:
        raise TypeError(f"DistributedOptimizer() got unexpected keyword arguments "
                        f"{sorted(unknown)}; Slim-DP keywords are {sorted(SLIM_KEYWORDS)}")

    adasum = op is not None and op == Adasum
    op_name = _check_horovod_args(backward_passes_per_step, op, gradient_predivide_factor,
                                  num_groups, groups)
    members = process_set_ranks(process_set)
    if compression is None:
        compression = Compression.none
    for attr in ("compress", "decompress"):
        if not callable(getattr(compression, attr, None)):
            raise ValueError(f"compression must have compress() and decompress() like "
                             f"hvd.Compression.none, got {compression!r}")
    kwargs = dict(slim_kwargs)
    transport = kwargs.pop("transport", None)
    outer = kwargs.pop("outer_optimizer", None)
    explicit = dict(kwargs, op=op_name, gradient_predivide_factor=gradient_predivide_factor,
                    backward_passes_per_step=backward_passes_per_step)
    if members is not None and "server_rank" not in explicit \
            and ENV_PREFIX + "SERVER_RANK" not in os.environ:
        explicit["server_rank"] = members[0]   # a set's first rank, as rank 0 is the job's
    config = resolve_config(explicit)
    config = config.replaced(**config.local_defaults())   # local steps: SparseLoCo's recipe
    if adasum:
        raise ValueError(_adasum_refusal(config))
    outer = check_outer_optimizer(outer, [p for _, p in named if p.requires_grad],
                                  config.local_steps, config.env_note("local_steps"))
    if config.local_steps > 1:   # ranks stepping other outer optimizers would drift apart
        config = config.agreeing(
            outer_optimizer=describe_outer_optimizer(outer, config.density))
    if members is None:
        transport = _resolve_transport(transport, named)
        config.check_world(transport.size)
        return SlimSettings(config, named, compression, transport, outer=outer)
    config.for_ranks(members)   # server_rank must be in the set: checked on every rank alike
    if basics.rank() not in members:   # Horovod: outside its set the optimizer steps alone
        parameter_device(named)
        return SlimSettings(config, named, compression, None, members)
    transport = _resolve_transport(transport, named, process_set)
    if transport.size != len(members):
        raise ValueError(f"transport: {transport!r} spans {transport.size} ranks but "
                         f"process_set has {len(members)} ({members})")
    return SlimSettings(config, named, compression, transport, members, outer=outer)


def process_set_ranks(process_set: Any) -> Optional[List[int]]:
    """The job ranks of ``process_set``, or None for the whole job (None or
    ``hvd.global_process_set``). Raises ValueError naming ``process_set`` for anything but a
    registered :class:`hvd_slim.ProcessSet`. Communicates nothing: every rank knows every
    registered set's ranks."""
    if process_set is None:
        return None
    if not isinstance(process_set, sets.ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet registered with "
                         f"hvd.add_process_set() or hvd.init(process_sets=...), "
                         f"hvd.global_process_set or None; got {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        return None
    try:
        return sets.members(process_set)
    except ValueError as exc:
        raise ValueError(f"process_set: {exc}") from None


def _resolve_transport(transport: Any, named: List[Tuple[str, torch.Tensor]],
                       process_set: Any = None) -> Transport:
    """A Transport instance is used as given; a name (or ``HVD_SLIM_TRANSPORT``) is resolved by
    :func:`hvd_slim.optim.transport_choice.resolve` for the device the parameters live on
    (and the process set the exchange runs in, if any)."""
    device = parameter_device(named)
    if isinstance(transport, Transport):
        return transport
    return resolve(transport, device, process_set=process_set)


def parameter_device(named: List[Tuple[str, torch.Tensor]]) -> torch.device:
    """The one device every parameter lives on (CPU when there are none). One optimizer's
    exchange runs over one transport, so parameters on several devices are refused, naming one
    parameter on each."""
    first: Dict[torch.device, str] = {}
    for name, p in named:
        first.setdefault(p.device, name)
    if len(first) > 1:
        shown = "; ".join(f"{name!r} is on {dev}" for dev, name in list(first.items())[:3])
        raise ValueError(f"DistributedOptimizer: the parameters are on {len(first)} devices ({shown}). "
                         "hvd_slim exchanges one optimizer's gradients over one transport: move the "
                         "model to one device first (model.to(device)), or wrap one optimizer per "
                         "device")
    return next(iter(first), torch.device("cpu"))


def momentum_plan(optimizer: torch.optim.Optimizer, layout: Layout, config: SlimConfig
                  ) -> Dict[int, dict]:
    """Momentum-correction settings per compressed bucket ({} where it is off)."""
    mc = config.momentum_correction
    is_sgd = isinstance(optimizer, torch.optim.SGD)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    plan: Dict[int, dict] = {}
    for b in layout.sparse:
        specs = {(float(group_of[id(p)].get("momentum", 0.0)),
                  float(group_of[id(p)].get("dampening", 0.0)),
                  bool(group_of[id(p)].get("nesterov", False))) for p in b.params()}
        has_momentum = is_sgd and any(m > 0 for m, _, _ in specs)
        if mc is None and not has_momentum:
            continue
        if mc is False:
            continue
        if not has_momentum:
            raise ValueError("momentum_correction=True needs torch.optim.SGD with momentum > 0; "
                             f"got {type(optimizer).__name__}. Leave it unset (auto) or False")
        if len(specs) > 1:
            raise ValueError("momentum_correction needs the same momentum, dampening and nesterov "
                             f"for every compressed parameter of dtype {b.dtype}; param groups "
                             f"differ: {sorted(specs)}. Pass momentum_correction=False")
        m, damp, nesterov = specs.pop()
        plan[b.index] = {"momentum": m, "dampening": damp, "nesterov": nesterov}
    return plan


def adopt_source(opt: torch.optim.Optimizer, settings: SlimSettings,
                 source: torch.optim.Optimizer) -> None:
    """What every hvd_slim optimizer (in its set or outside it) takes from the user's optimizer
    and its settings. Horovod rebuilds the optimizer from param_groups only; hvd_slim also keeps
    the source's defaults (for add_param_group) and any state it has loaded."""
    opt.defaults = dict(source.defaults)
    for p, st in source.state.items():
        opt.state[p] = st
    opt._hvd_slim_wrapped = True  # type: ignore[attr-defined]
    opt._settings = settings  # type: ignore[attr-defined]
    opt.backward_passes_per_step = settings.config.backward_passes_per_step  # type: ignore[attr-defined]
