"""``hvd_slim.DistributedOptimizer``: Horovod's factory, validated up front, returning an
instance of the user's optimizer class extended by optim/optimizer.py's methods."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, List, Optional, Tuple, Union

import torch

from .inner.adam_update import resolve_mode
from .optimizer import _SlimOptimizer
from .outside_set import outside_set_optimizer
from ..config import UNSET
from .wrapping import SLIM_KEYWORDS, named_parameter_list, resolve_settings

log = logging.getLogger("hvd_slim")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = None, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None, *,
                         # what to tune (README, "DistributedOptimizer keywords")
                         density: float = UNSET, value_bits: int = UNSET,
                         pull_value_bits: Optional[int] = UNSET, exploration: float = UNSET,
                         servers: Union[int, str] = UNSET, hierarchical: bool = UNSET,
                         overlap: Union[bool, int] = UNSET, local_steps: int = UNSET,
                         adam_exchange: str = UNSET, nonfinite: str = UNSET,
                         timeout: Optional[float] = UNSET, transport: Any = UNSET,
                         # the rest (docs/keywords.md; experimental ones say so there)
                         momentum_correction: Optional[bool] = UNSET,
                         momentum_masking: Union[bool, float] = UNSET,
                         pull: str = UNSET, pull_density: Optional[float] = UNSET,
                         min_compress_numel: int = UNSET, magnitude_weight: float = UNSET,
                         server_rank: int = UNSET, seed: int = UNSET,
                         warmup_dense_steps: int = UNSET,
                         warmup_decay_steps: Optional[int] = UNSET,
                         warmup_start_density: Optional[float] = UNSET,
                         warmup_settle: Optional[float] = UNSET,
                         overlap_forward: bool = UNSET, outer_optimizer: Any = UNSET,
                         outer_delay: int = UNSET, residual_decay: float = UNSET,
                         adam_variance: str = UNSET,
                         sparse_average: str = UNSET) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that each ``step()`` exchanges gradients with Slim-DP.

    Build it on every rank alike: starting the transport (and, inside Horovod, hvd_slim itself)
    is collective. Every argument is validated here, before any state is built; errors name the
    argument, or the environment variable it came from. Horovod's arguments keep Horovod's
    meaning; the Slim-DP keywords a user tunes are tabulated in README.md ("DistributedOptimizer
    keywords"), the rest in docs/keywords.md, and docs/design.md explains them.

    The Slim-DP keywords (from ``density`` on) are keyword-only. Each one left unset reads
    ``HVD_SLIM_<NAME>`` from the environment, then takes its default (for torch's Adam and AdamW
    the update exchange's own: ``density=0.05``, ``value_bits=2``, ``pull_value_bits=8``, and
    a pull 4x the push density).
    Tune ``density`` first, then ``value_bits``.

    Args:
        optimizer: The ``torch.optim.Optimizer`` to wrap, not yet wrapped by hvd_slim.
        named_parameters: ``(name, parameter)`` tuples, usually ``model.named_parameters()``:
            unique str names, every optimizer parameter named (else ValueError). None
            (default) generates names.
        compression: ``hvd.Compression.none`` (default, also for None) or
            ``hvd.Compression.fp16``; only dtype-casting compressors work (ValueError).
        backward_passes_per_step: Backward passes whose gradients accumulate (sum) locally
            before one exchange (default 1); one more pass before ``step()`` raises
            AssertionError.
        op: ``hvd.Average`` (default, also for None) or ``hvd.Sum``; ``hvd.Adasum`` (a
            dense reduction, not implemented at any density, 1.0 included) and other ops
            raise ValueError.
        gradient_predivide_factor: As Horovod's: gradients are scaled by ``1/f`` before the
            exchange and ``f/size`` after it (default 1.0; only with ``op=Average``).
        num_groups: Accepted (an int >= 0; non-zero warns as deprecated) with no effect.
        groups: Accepted (None, a positive int or a list of lists of parameters) with no
            effect: the exchange is always one fused message per step.
        sparse_as_dense: Accepted with no effect: sparse gradients are always densified.
        process_set: None or ``hvd.global_process_set`` (default: every rank), or a
            registered ``hvd.ProcessSet``: the exchange runs among its ranks only, on MPI
            (``transport="gloo"``/``"nccl"`` raise ValueError there), with ``server_rank`` a
            job rank in the set (default: its first). Build it on every rank alike: as in
            Horovod, a rank outside the set gets the plain optimizer (no exchange).
        density: Fraction of the compressed coordinates each worker pushes (default 0.02).
        value_bits: 1, 2, 4, 8 (default), 16 or 32: the precision of sliced values; what rounding
            loses stays in the residual. 1 is each value's sign at the section's mean
            magnitude; with ``density=1.0`` every coordinate's sign is pushed, no indices (1-bit
            Adam's push: 32x fewer bytes), where other bits at 1.0 are the exact dense average.
            Alone, ``value_bits=1`` sets ``density=1.0`` and the server's whole sum pulled at 8
            bits (``pull_density=1.0``, ``pull_value_bits=8``) where those are not set.
        pull_value_bits: The same for the server's slice (default None: ``value_bits``).
        exploration: Share of each slice spent on seeded random coordinates (default 0.1).
        servers: Server shards, 1 (default) to the number of ranks, or ``"auto"``: each
            aggregates about 1/S of every tensor, so no rank's link carries every push.
        hierarchical: With several ranks per host, combine each host's gradients first, then
            exchange between the hosts (default False).
        overlap: ``True`` (4 stages) or a number of stages, each exchanged as soon as its
            gradients are ready in backward, on a communication thread (default 1: none).
        local_steps: H > 1 steps the wrapped optimizer H times on local gradients, then
            exchanges the pseudo-gradient ``global - local`` for an outer step (default 1).
        adam_exchange: ``"auto"`` (default) | ``"update"`` | ``"gradient"``; for Adam and
            AdamW, what travels: each rank's own Adam update (what ``"auto"`` picks for torch's
            Adam and AdamW; ``step()`` applies the delivered average as a parameter delta) or
            the gradient into one shared Adam.
        nonfinite: What a NaN/Inf gradient on any rank does. ``"flag"`` (default): every rank
            skips the step (residuals, velocities and server state untouched, the wrapped
            optimizer not stepped) and gets NaN in every ``p.grad``, so
            ``torch.amp.GradScaler`` skips and backs off on every rank alike; ``"skip"``: the
            same, ``p.grad`` keeping this rank's gradients; ``"raise"``:
            NonFiniteGradientError on every rank; ``"propagate"``: no check.
        timeout: Seconds a rank waits in the exchange before failing (default 600); None or
            0 waits forever.
        transport: ``"mpi"``, ``"gloo"``, ``"nccl"`` or ``"auto"`` (default: NCCL for CUDA
            parameters when available, Gloo under torchrun before hvd_slim starts, else MPI),
            or a transport instance (tests).
        momentum_correction: DGC-style local velocity (default None: on for SGD with momentum).
        momentum_masking: Share of the local velocity dropped where a coordinate is sent
            (default 0.0).
        pull: ``"slim"`` (default: the server keeps a residual and pulls a slice) or
            ``"union"`` (the exact sum of what was pushed).
        pull_density: Slice size of the server's pull with ``pull="slim"`` (default None:
            derived from ``density``, 2x it; 4x it for Adam's update exchange).
        min_compress_numel: Tensors smaller than this are fused and sent dense (default 4096).
        magnitude_weight: Weight of ``|w|`` next to ``|a|`` in the significance score
            (default 0.0).
        server_rank: The job rank that aggregates; it is also a worker (default 0).
        seed: Keys the exploration generator every replica shares (default 0).
        warmup_dense_steps: Dense first steps (default 0).
        warmup_decay_steps: Steps of the geometric decay from ``warmup_start_density`` to
            ``density`` (default None: 1/density steps).
        warmup_start_density: Where that decay starts (default None: 8x ``density``, at least
            0.05).
        warmup_settle: End the warm-up on a measured signal: the start density holds while
            the pulled update's norm changes by more than this fraction from one window of
            steps to the next, then a decay a quarter as long runs; never longer than the
            warm-up by count (default None: the decay starts at once).
        overlap_forward: With ``overlap``, once backward is over send the stages nearest the
            input first and let ``step()`` return before the rest is back; each stage's update
            is applied when the next forward pass reaches its modules (``model.state_dict()``
            lands them first; call ``optimizer.apply_updates()`` before reading parameters
            outside a forward otherwise). Default False.
        outer_optimizer: With ``local_steps``, a ``torch.optim.Optimizer`` over the same
            parameters (default None: over a sparse exchange SGD at lr 1 without momentum;
            with ``density=1.0`` DiLoCo's SGD at lr 0.7 with Nesterov momentum 0.9).
        outer_delay: With ``local_steps``, ``1`` overlaps a round's exchange with the next
            round and applies its outer step one round late; ``0`` (default) waits for it at
            the round's end.
        residual_decay: Each step the worker's residual is multiplied by this before the new
            gradient joins it; ``1.0`` (default) keeps every unsent value until it is sent.
            Below 1 it is SparseLoCo's decayed error feedback.
        adam_variance: ``"auto"`` (default) | ``"rescaled"`` | ``"live"``; with
            ``adam_exchange="gradient"``, how the second moment sees sparse deliveries
            (optim/inner/adam.py).
        sparse_average: ``"ranks"`` (default) divides each sliced coordinate's sum by the
            number of ranks; ``"senders"`` by the ranks whose slices held it that step, so a
            coordinate one rank sends moves by that rank's value at once (biased: the other
            ranks' shares follow when they send them). Needs ``op=Average``,
            ``pull="slim"`` and ``hierarchical=False``.

    Returns:
        An instance of a class created on the fly that subclasses ``optimizer``'s class (same
        name), as Horovod does, so ``isinstance(opt, torch.optim.SGD)`` and the
        hyperparameters in ``param_groups`` carry over, with the optimizer's defaults and
        state. It adds Horovod's ``synchronize()``, ``skip_synchronize()`` and
        ``set_backward_passes_per_step()``, and ``flush()``, ``comm_stats()``,
        ``slim_config`` and a per-rank ``state_dict()``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or a keyword is unknown.
        ValueError: ``optimizer`` is already an hvd_slim ``DistributedOptimizer``; a bad
            Horovod argument (above); parameters on several devices; a transport that is not
            available; MPI chosen before ``hvd_slim.init()`` (outside Horovod);
            ``momentum_correction=True`` without ``torch.optim.SGD`` momentum.
        ConfigError: (a ValueError) a value out of range or conflicting with another: a
            Slim-DP keyword, ``backward_passes_per_step`` or ``gradient_predivide_factor``.
    """
    # The Slim-DP keywords given (UNSET: not given, so HVD_SLIM_<NAME> or the default applies).
    slim_kwargs = {k: v for k, v in locals().items() if k in SLIM_KEYWORDS and v is not UNSET}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if getattr(optimizer, "_hvd_slim_wrapped", False):
        raise ValueError("optimizer is already an hvd_slim.DistributedOptimizer: wrap the "
                         "original optimizer once")
    named = named_parameter_list(optimizer, named_parameters)
    settings = resolve_settings(named, compression, backward_passes_per_step, op,
                                gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                                process_set, slim_kwargs)
    if not settings.included:
        return outside_set_optimizer(optimizer, settings)
    mode, why = resolve_mode(optimizer, settings.config, type(optimizer))
    if why is not None:
        log.info("hvd_slim: adam_exchange='auto' exchanges gradients here: %s", why)
    fields = {"adam_exchange": mode}
    if mode == "update":   # its own density and value_bits, unless the user set them
        fields.update(settings.config.update_defaults())
    settings = dataclasses.replace(settings, config=settings.config.replaced(**fields))
    if settings.transport.rank == 0 and log.isEnabledFor(logging.INFO):
        log.info("hvd_slim: DistributedOptimizer(%s) over %d ranks: %s",
                 type(optimizer).__name__, settings.transport.size,
                 settings.config.describe_sources())
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_SlimOptimizer.__dict__))
    return cls(optimizer.param_groups, settings, optimizer)


__all__: List[str] = ["DistributedOptimizer"]
