"""Up-front validation of ``DistributedOptimizer``'s arguments, and what they resolve to."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .config import ENV_KEYWORDS, SlimConfig
from .config_env import resolve_config
from .exchange.layout import Layout
from .transport.base import Transport

SLIM_KEYWORDS = set(ENV_KEYWORDS) | {"transport"}


@dataclass(frozen=True)
class SlimSettings:
    config: SlimConfig
    named_parameters: List[Tuple[str, torch.Tensor]]
    compression: Any
    transport: Transport


def named_parameter_list(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable]) -> List[Tuple[str, torch.Tensor]]:
    """Horovod's checks: tuples, unique names, every optimizer parameter named. Returns the
    (name, param) pairs of the optimizer's parameters."""
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"noname.{gi}.{i}", p) for gi, g in enumerate(optimizer.param_groups)
                for i, p in enumerate(g["params"])]
    named = list(named_parameters)
    bad = [x for x in named if not (isinstance(x, tuple) and len(x) == 2)]
    if bad:
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         f"usually produced by model.named_parameters(); got {type(bad[0])}")
    seen, dups = set(), set()
    for name, _ in named:
        if not isinstance(name, str):
            raise ValueError(f"named_parameters: names must be strings, got {name!r}")
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(dups)))
    by_id = {id(p): n for n, p in named}
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
                        groups, process_set) -> str:
    from .collectives import Adasum, Average, Sum

    if process_set is not None:
        raise ValueError("process_set is not supported by hvd_slim: the exchange always spans "
                         "every rank of hvd_slim.init(); leave process_set unset")
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
    from .collectives import Adasum

    adasum = op is not None and op == Adasum
    op_name = _check_horovod_args(backward_passes_per_step, op, gradient_predivide_factor,
                                  num_groups, groups, process_set)
    if compression is None:
        from .compression import Compression
        compression = Compression.none
    for attr in ("compress", "decompress"):
        if not callable(getattr(compression, attr, None)):
            raise ValueError(f"compression must have compress() and decompress() like "
                             f"hvd.Compression.none, got {compression!r}")
    kwargs = dict(slim_kwargs)
    transport = kwargs.pop("transport", None)
    config = resolve_config(dict(kwargs, op=op_name,
                                 gradient_predivide_factor=gradient_predivide_factor,
                                 backward_passes_per_step=backward_passes_per_step))
    if adasum:
        raise ValueError(_adasum_refusal(config))
    transport = _resolve_transport(transport, named)
    config.check_world(transport.size)
    return SlimSettings(config, named, compression, transport)


def _resolve_transport(transport: Any, named: List[Tuple[str, torch.Tensor]]) -> Transport:
    """A Transport instance is used as given; a name (or ``HVD_SLIM_TRANSPORT``) is resolved by
    :func:`hvd_slim.runtime.choose_transport.resolve` for the device the parameters live on."""
    device = parameter_device(named)
    if isinstance(transport, Transport):
        return transport
    from .runtime.choose_transport import resolve
    return resolve(transport, device)


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
