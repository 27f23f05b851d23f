"""Slim-DP configuration: one frozen, validated dataclass.

Every Slim-DP keyword of :func:`hvd_slim.DistributedOptimizer` lands here. A keyword the caller
does not pass takes its default from the environment variable ``HVD_SLIM_<NAME>`` (so an
unchanged script can be re-run at another density), and otherwise from the field default below.
Bad values and bad combinations are rejected at construction, with the argument (or variable)
named. The config is plain data: ``to_dict()`` checkpoints it without the communicator.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..wire.values import VALUE_BITS
# ConfigError stays importable from here, where every caller has always found it.
from .checks import (ConfigError, _check_fraction, _check_int, _check_local_steps,
                     _check_outer_delay, _check_overlap, _check_overlap_forward, _check_timeout,
                     _is_number)

PULL_MODES = ("slim", "union")
OPS = ("average", "sum")
# "flag" (default): skip the step everywhere and hand every rank NaN gradients, so that
# torch.amp.GradScaler's found_inf is set identically on every rank (Horovod's AMP pattern).
NONFINITE_MODES = ("flag", "skip", "raise", "propagate")
ADAM_VARIANCE_MODES = ("auto", "rescaled", "live")
# What an Adam-family optimizer exchanges (optim/inner/adam_update.py): "update" (each rank's own
# moments, its Adam update through the exchange), "gradient" (the gradients, one shared Adam);
# "auto" resolves to "update" for torch's Adam and AdamW when the optimizer is built.
ADAM_EXCHANGE_MODES = ("auto", "update", "gradient")
# How the server averages a sliced bucket's pushes (exchange/server.py): "ranks" divides each
# coordinate's sum by the N ranks (the exact mean once every rank has sent it); "senders" by the
# ranks whose slice held it this step, so a coordinate one rank sends moves by that rank's value
# now instead of 1/N of it, the others' shares following when they are sent.
SPARSE_AVERAGE_MODES = ("ranks", "senders")
# The update exchange's own defaults, for the keywords a user leaves unset: Adam's updates move
# every coordinate about lr a step, so staleness, not precision, is what costs accuracy there:
# more coordinates at fewer bits (docs/accuracy.md, "Transformers").
UPDATE_DEFAULTS = {"density": 0.05, "value_bits": 2, "pull_value_bits": 8}
# ... and its pull, 4x as dense as its push where the user set neither: the server's 8-bit slice
# then holds about the union of four ranks' pushes, where the gradient exchange's 2x sliced
# that union in half (the fair horizon's hardest seed: +6.4% -> +2.7% against dense).
UPDATE_PULL_RATIO = 4.0
# Local steps (local_steps > 1) over a sparse exchange, for the keywords a user leaves unset:
# SparseLoCo's recipe without its decay. A round's pseudo-gradient is already an optimizer's
# update (like the update exchange's), so more coordinates at fewer bits; the residual stands in
# for DiLoCo's outer momentum, which on top of error feedback counts momentum twice (outer/
# rounds.py has the outer step, plain SGD at lr 1). Every tensor is compressed: at 0.01 the small
# ones (1% of a transformer's coordinates) were 2/3 of a round's bytes sent dense. The warm-up
# ends on a signal (warmup_settle=0.5, exchange/warmup.py): counted in rounds it spanned a whole
# short run at up to 8x the bytes, and no warm-up at all cost accuracy (below). No decay: at 0.01 a
# coordinate is sent about every 100 rounds, and SparseLoCo's 0.95 fades what waits longer than
# about 20 (fair horizon, H = 8: 2.658 bits per byte with it, 2.389 without; docs/accuracy.md,
# "Local steps at their defaults"). A coordinate's sum averaged over the ranks that sent it
# (sparse_average="senders"), not over all N: at 0.01 the ranks' slices barely overlap, and a
# coordinate one rank sends moved by a quarter of its value at 4 ranks (the language model at
# H = 8: +5.8% against local_steps=1 over 3 seeds of 600 steps where the mean over every rank
# was +13.9%, and +5.1% against +24% on the fair horizon); where the user's op, pull or
# hierarchical rules it out, the mean over every rank stays. With both, +4.3% over 3 seeds of
# 600 steps at 2,023x fewer bytes per local step (docs/accuracy.md, "Averaging over the ranks
# that sent"), within the 5% and 2,000x the local-work issue asks for.
# DiLoCo's own dense rounds (density=1.0) keep the plain defaults and its outer Nesterov.
LOCAL_DEFAULTS = {"density": 0.01, "value_bits": 2, "pull_value_bits": 8,
                  "min_compress_numel": 0, "warmup_decay_steps": None, "warmup_settle": 0.5,
                  "sparse_average": "senders"}
LOCAL_PULL_RATIO = 4.0
# value_bits=1, for the keywords a user leaves unset, whatever the optimizer: every coordinate's
# sign (density 1.0: no indices, 32x fewer pushed bytes than float32; 1-bit Adam's push, with
# error feedback) and the server's whole sum pulled at 8 bits (coded, no selection: 4x fewer
# bytes than float32). AdamW at the fair horizon: -0.01% ± 0.41 against dense over 5 seeds,
# ahead of the update exchange's defaults (+2.03%) on every seed; half the sum pulled at 8 bits
# (6x) ended +1.32% (3 seeds); a pull of every sign lost in the screen (+1.89%). The price: 24x
# fewer pushed bytes where the defaults push 45x fewer, and 5x their arithmetic on a CPU
# (docs/accuracy.md, "The sign push at the fair horizon").
SIGN_DEFAULTS = {"density": 1.0, "pull_value_bits": 8}
SIGN_PULL_RATIO = 1.0
ENV_PREFIX = "HVD_SLIM_"


class _Unset:
    """The default of every Slim-DP keyword of ``DistributedOptimizer``: not given, so
    ``HVD_SLIM_<NAME>`` applies, else the built-in default. (None cannot stand for it: an
    explicit ``timeout=None`` means waiting forever.)"""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

# Keywords that may come from HVD_SLIM_<NAME>; the Horovod ones (op, ...) are always explicit.
ENV_KEYWORDS = ("density", "exploration", "magnitude_weight",
                "momentum_correction", "pull", "pull_density", "min_compress_numel",
                "server_rank", "seed", "nonfinite", "timeout", "warmup_dense_steps",
                "warmup_decay_steps", "adam_variance", "momentum_masking", "value_bits",
                "warmup_start_density", "servers", "hierarchical", "overlap", "overlap_forward",
                "local_steps", "outer_delay", "residual_decay", "adam_exchange",
                "pull_value_bits", "warmup_settle", "sparse_average")
# Settings each rank may choose for itself: left out of the digest the ranks compare.
LOCAL_FIELDS = ("timeout",)
# Settings a resumed run may change: left out of the checkpoint compatibility check.
# (overlap_forward: a checkpoint never holds a step in flight, it is saved after it lands.)
RESUMABLE_FIELDS = ("timeout", "nonfinite", "overlap_forward")
# servers="auto": as many shards as ranks, but none under this many compressed coordinates:
# every piece pays fixed costs per step (its selection, exploration generator, a section in
# every message; about 0.5 ms on this machine), which swamp what spreading the bytes saves on
# small shards (docs/performance.md, "Sharded servers").
AUTO_MIN_SHARD = 1 << 20
DEFAULT_TIMEOUT = 600.0  # seconds; torch.distributed's NCCL default, long enough for an evaluation


# The default pull slice: twice the push, and 4x it (but at most PULL_FLOOR) at low densities,
# where a second compression at the server delays most (docs/accuracy.md).
PULL_RATIO, PULL_MAX_RATIO, PULL_FLOOR = 2.0, 4.0, 0.004
# The automatic warm-up (see SlimConfig.densities_at): the push starts WARMUP_BOOST x denser, and
# never sparser than WARMUP_FLOOR, and falls geometrically to the target over about 1/density
# steps, the time error feedback takes to fill its residuals (an average coordinate is first
# sent after ~1/density steps). The floor matters below a density of 0.00625: there 8x still
# moves a coordinate about once in 1/(8 density) steps, and DGC's warm-up starts at 25% whatever
# its target (MNIST-1D under Adam at 0.001, 10 seeds: -0.78 points against dense from 8x,
# -0.12 from 5%).
WARMUP_BOOST, WARMUP_FLOOR = 8.0, 0.05


def default_pull_density(density: float) -> float:
    """The pull density used when ``pull_density`` is not given: ``max(2 * density,
    min(4 * density, 0.004))``, at most 1 (0.04 at the default density, 0.004 at 0.001)."""
    return min(1.0, max(PULL_RATIO * density, min(PULL_MAX_RATIO * density, PULL_FLOOR)))


@dataclass(frozen=True)
class SlimConfig:
    """Validated Slim-DP settings (docs/design.md §2 and §4 say what each one does)."""

    # --- slice sizes -------------------------------------------------------------------------
    density: float = 0.02              # k/d: fraction of compressed coordinates a worker pushes
    pull_density: Optional[float] = None  # k_pull/d for pull="slim"; None: see default_pull_density
    min_compress_numel: int = 4096     # tensors smaller than this are fused and sent dense
    # --- selection ---------------------------------------------------------------------------
    exploration: float = 0.1           # epsilon: share of each slice given to random exploration
    magnitude_weight: float = 0.0      # lambda in |a| + lambda*|w|; 0 = gradient magnitude only
    value_bits: int = 8                # bits of each sliced value: 1 (signs), 2, 4 (packed),
    #                                    8 (scaled fp8), 16 (bf16), 32
    # The server's pull slice (pull="slim") at these bits; None: value_bits
    pull_value_bits: Optional[int] = None
    # --- warm-up (see densities_at) -----------------------------------------------------------
    warmup_dense_steps: int = 0        # the first exchange steps are an exact dense average
    # Then the densities decay geometrically from warmup_start_density to their targets over
    # warmup_decay_steps; None: automatic (8x the density but at least 5%, over ceil(1/density)
    # steps)
    warmup_decay_steps: Optional[int] = None
    warmup_start_density: Optional[float] = None
    # None: the decay starts at once. A fraction eta: the start density holds while the pulled
    # update's norm still changes by more than eta from one window of steps to the next, then
    # the decay runs (exchange/warmup.py); never longer than the warm-up by count.
    warmup_settle: Optional[float] = None
    # --- the wrapped optimizer -----------------------------------------------------------------
    momentum_correction: Optional[bool] = None  # None = on for SGD with momentum > 0
    # Share of a rank's velocity dropped where a coordinate is sent: 1.0 (True) is DGC's momentum
    # masking, 0.0 (False) keeps it all (what is delivered then sums to dense momentum SGD's)
    momentum_masking: float = 0.0
    # Error feedback: each step a worker's residual is multiplied by this before the new
    # gradient joins it (memory/residual.py); 1.0 keeps everything until it is sent. Below 1,
    # SparseLoCo's decayed accumulator: unsent mass fades over about 1/(1 - beta) steps.
    residual_decay: float = 1.0
    # Adam/AdamW: "rescaled" feeds exp_avg_sq each delivered value as per-step means of the steps it
    # sums (optim/inner/adam.py); "live": Adam's own step on the bursts; "auto": rescaled for Adam
    adam_variance: str = "auto"
    # Adam/AdamW: "update" exchanges each rank's Adam update (its own moments on its own gradient)
    # instead of the gradient (optim/inner/adam_update.py); "gradient": the gradient into one shared
    # Adam, as adam_variance says; "auto": "update" for torch's Adam and AdamW
    adam_exchange: str = "auto"
    # --- server and reduction ----------------------------------------------------------------
    pull: str = "slim"                 # "slim": server keeps a residual; "union": exact union
    # A sliced bucket's coordinate averaged over all ranks ("ranks") or over those that sent it
    # this step ("senders"; op average and pull "slim" only): see SPARSE_AVERAGE_MODES.
    sparse_average: str = "ranks"
    server_rank: int = 0               # rank that aggregates pushes (it is also a worker)
    # Server shards: each aggregates 1/S of every bucket (exchange/shards.py); "auto": see
    # servers_for. Shard 0 is server_rank's, the others evenly spaced after it.
    servers: Any = 1
    # Node-local aggregation (exchange/hosts/hierarchy.py): the ranks of each host first combine
    # their gradients over the local link, then one exchange per local rank runs between the hosts.
    hierarchical: bool = False
    # Overlap with backward (exchange/overlap/staged.py): the model is cut into this many stages in
    # backward order, each exchanged as soon as its gradients are ready; 1: all in step().
    # True means config_checks.OVERLAP_STAGES, False 1.
    overlap: int = 1
    # With overlap > 1 (exchange/overlap/order.py, hvd_slim/optim/forward_apply.py): once backward
    # is over the stages nearest the input go first (P3's order), and step() returns before the rest
    # is back; each stage's update lands when the next forward pass reaches its modules.
    overlap_forward: bool = False
    # Local steps (outer/rounds.py): the wrapped optimizer steps alone this many times, then
    # the pseudo-gradient (global - local parameters) goes through the exchange to an outer
    # optimizer; 1: every step exchanges its gradients.
    local_steps: int = 1
    # With local steps: 1 overlaps a round's exchange with the next round, and its outer step
    # lands one round late (Streaming DiLoCo's delayed application); 0: it waits.
    outer_delay: int = 0
    op: str = "average"                # "average" or "sum" of the workers' contributions
    gradient_predivide_factor: float = 1.0  # Horovod's: scale by 1/f before, f/N after (average)
    backward_passes_per_step: int = 1  # local backward passes accumulated per exchange
    # --- randomness --------------------------------------------------------------------------
    seed: int = 0                      # keys every replica's exploration generator
    # --- failure handling --------------------------------------------------------------------
    # NaN/Inf gradient on any rank: "flag" (skip the step, NaN grads on every rank), "skip" (keep
    # this rank's grads), "raise" NonFiniteGradientError on every rank, or "propagate" (no check)
    nonfinite: str = "flag"
    timeout: Optional[float] = DEFAULT_TIMEOUT  # seconds to wait in the exchange; None: forever

    def __post_init__(self) -> None:
        # Values are normalised to plain Python types, so the digest (a repr) is the same on
        # ranks that passed np.float32(0.01) and 0.01.
        norm: Dict[str, Any] = {
            "density": _check_fraction("density", self.density, low_open=True),
            "exploration": _check_fraction("exploration", self.exploration, low_open=False)}
        if self.pull_density is not None:
            norm["pull_density"] = _check_fraction("pull_density", self.pull_density, True)
        w = self.magnitude_weight
        if not _is_number(w) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"magnitude_weight must be a finite number >= 0, got {w!r}",
                              "magnitude_weight")
        norm["magnitude_weight"] = float(w)
        for name, low in (("min_compress_numel", 0),
                          ("server_rank", 0), ("backward_passes_per_step", 1), ("seed", 0),
                          ("warmup_dense_steps", 0)):
            norm[name] = _check_int(name, getattr(self, name), low)
        if self.warmup_decay_steps is not None:
            norm["warmup_decay_steps"] = _check_int("warmup_decay_steps",
                                                    self.warmup_decay_steps, 0)
        if self.value_bits not in VALUE_BITS or isinstance(self.value_bits, bool):
            raise ConfigError(f"value_bits must be one of {VALUE_BITS}, got {self.value_bits!r}",
                              "value_bits")
        norm["value_bits"] = int(self.value_bits)
        if self.pull_value_bits is not None:
            if self.pull_value_bits not in VALUE_BITS or isinstance(self.pull_value_bits, bool):
                raise ConfigError(f"pull_value_bits must be one of {VALUE_BITS} or None (as "
                                  f"value_bits), got {self.pull_value_bits!r}", "pull_value_bits")
            norm["pull_value_bits"] = int(self.pull_value_bits)
        if self.warmup_start_density is not None:
            start = _check_fraction("warmup_start_density", self.warmup_start_density, True)
            if start < norm["density"]:
                raise ConfigError(f"warmup_start_density ({start!r}) must not be below density "
                                  f"({norm['density']!r}): the warm-up falls from it to density",
                                  "warmup_start_density")
            norm["warmup_start_density"] = start
        if self.warmup_settle is not None:
            norm["warmup_settle"] = _check_fraction("warmup_settle", self.warmup_settle, True)
        mm = self.momentum_masking
        norm["momentum_masking"] = float(mm) if isinstance(mm, bool) else \
            _check_fraction("momentum_masking", mm, low_open=False)
        norm["residual_decay"] = _check_fraction("residual_decay", self.residual_decay,
                                                 low_open=True)
        if self.momentum_correction not in (None, True, False):
            raise ConfigError(f"momentum_correction must be True, False or None (auto), "
                              f"got {self.momentum_correction!r}", "momentum_correction")
        for name, allowed in (("pull", PULL_MODES), ("op", OPS), ("nonfinite", NONFINITE_MODES),
                              ("adam_variance", ADAM_VARIANCE_MODES),
                              ("adam_exchange", ADAM_EXCHANGE_MODES),
                              ("sparse_average", SPARSE_AVERAGE_MODES)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}",
                                  name)
        f = self.gradient_predivide_factor
        if not _is_number(f) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"gradient_predivide_factor must be a finite number > 0, got {f!r}",
                              "gradient_predivide_factor")
        norm["gradient_predivide_factor"] = float(f)
        if f != 1.0 and self.op != "average":
            raise ConfigError("gradient_predivide_factor not supported with op != Average: "
                              "use op=hvd.Average or leave the factor at 1.0",
                              "gradient_predivide_factor")
        why = self.senders_ruled_out()
        if self.sparse_average == "senders" and why:
            raise ConfigError(f"sparse_average='senders' averages a coordinate over the ranks "
                              f"that sent it, which needs op=Average, pull='slim' and "
                              f"hierarchical=False; here {why}. Leave sparse_average 'ranks'",
                              "sparse_average")
        norm["timeout"] = _check_timeout(self.timeout)
        if self.servers != "auto":
            if isinstance(self.servers, str):
                raise ConfigError(f"servers must be an integer >= 1 or 'auto', got "
                                  f"{self.servers!r}", "servers")
            norm["servers"] = _check_int("servers", self.servers, 1)
        if not isinstance(self.hierarchical, bool) and type(self.hierarchical).__name__ != "bool_":
            raise ConfigError(f"hierarchical must be True or False, got {self.hierarchical!r}",
                              "hierarchical")
        norm["hierarchical"] = bool(self.hierarchical)
        norm["overlap"] = _check_overlap(self.overlap)
        norm["overlap_forward"] = _check_overlap_forward(self.overlap_forward, norm["overlap"])
        norm["local_steps"] = _check_int("local_steps", self.local_steps, 1)
        if norm["local_steps"] > 1:
            _check_local_steps(norm, self.momentum_correction)
        norm["outer_delay"] = _check_outer_delay(self.outer_delay, norm["local_steps"])
        for name, value in norm.items():
            object.__setattr__(self, name, value)
        if self.warmup_settle is not None and self.effective_warmup_decay_steps == 0:
            raise ConfigError(f"warmup_settle={self.warmup_settle!r} ends a warm-up, but there is "
                              f"none: warmup_decay_steps is 0 (or the warm-up starts at "
                              f"density). Pass warmup_decay_steps=None (automatic) or a count "
                              f"> 0, or leave warmup_settle unset",
                              "warmup_settle")

    # --- derived -------------------------------------------------------------------------------
    @property
    def effective_pull_density(self) -> float:
        return default_pull_density(self.density) if self.pull_density is None \
            else self.pull_density

    @property
    def effective_pull_value_bits(self) -> int:
        """The bits of the server's pull slice: ``pull_value_bits``, or ``value_bits``."""
        return self.value_bits if self.pull_value_bits is None else self.pull_value_bits

    @property
    def effective_warmup_decay_steps(self) -> int:
        """The decay's exchange steps: as given, or (None) ``ceil(1 / density)`` local steps'
        worth, ``ceil(1 / (density * local_steps))`` exchanges, when the core is re-selected
        every step and the warm-up starts above the target; 0 otherwise. (Counted in exchanges,
        a run of 600 local steps at H = 32 would never have left it: 19 rounds of ~6% density
        where 1% was asked for.)"""
        if self.warmup_decay_steps is not None:
            return self.warmup_decay_steps
        if self.effective_warmup_start_density <= self.density:
            return 0
        return math.ceil(1.0 / (self.density * self.local_steps))

    @property
    def effective_warmup_start_density(self) -> float:
        """The density the decay starts from: as given, or ``min(1, max(8 * density,
        0.05))``."""
        if self.warmup_start_density is not None:
            return self.warmup_start_density
        return min(1.0, max(WARMUP_BOOST * self.density, WARMUP_FLOOR))

    @property
    def warmup_steps(self) -> int:
        return self.warmup_dense_steps + self.effective_warmup_decay_steps

    @property
    def warmup_hold_limit(self) -> int:
        """With ``warmup_settle``: the most exchange steps the start density holds. Held that
        long, and then decayed over :attr:`warmup_settle_decay` steps, the warm-up's push
        densities sum to no more than the count's: it sends about as many bytes at most (the index
        coding and each slice's rounding are not quite proportional). 0 without it."""
        if self.warmup_settle is None:
            return 0
        count, short = self.effective_warmup_decay_steps, self.warmup_settle_decay
        budget = sum(self.decay_densities(i, count)[0] for i in range(count)) - \
            sum(self.decay_densities(i, short)[0] for i in range(short))
        return max(0, math.floor(budget / self.effective_warmup_start_density))

    @property
    def warmup_settle_decay(self) -> int:
        """With ``warmup_settle``: the decay's steps once the hold ends, a quarter of the
        count's (what is held has already waited); without it, the count's."""
        decay = self.effective_warmup_decay_steps
        return decay if self.warmup_settle is None else math.ceil(decay / 4)

    def decay_densities(self, i: int, steps: int) -> Tuple[float, float]:
        """``(push, pull)`` at step ``i`` of a geometric decay of ``steps`` steps from the start
        densities (``i = -1``: the start itself) to the targets, which step ``steps`` reaches."""
        x = (i + 1) / (steps + 1)
        start, pull = self.effective_warmup_start_density, self.effective_pull_density
        pull_start = min(1.0, start * pull / self.density)
        push = start * (self.density / start) ** x
        return push, max(push, pull_start * (pull / pull_start) ** x)

    def densities_at(self, step: int) -> Optional[Tuple[float, float]]:
        """``(push, pull)`` densities of exchange step ``step`` during the warm-up, else None.

        Steps ``[0, D)`` are dense (1.0). Step ``D + i`` of the ``S`` decay steps pushes
        ``start * (density / start) ** ((i + 1) / (S + 1))``, a geometric path from the start
        density to the target, which step ``D + S`` reaches; the pull follows the same path from
        ``min(1, start * pull / density)`` (never below the push). With ``start = 1`` this is
        the decay from dense, ``density ** ((i + 1) / (S + 1))``."""
        dense, decay = self.warmup_dense_steps, self.effective_warmup_decay_steps
        if step >= dense + decay:
            return None
        if step < dense:
            return 1.0, 1.0
        return self.decay_densities(step - dense, decay)

    def check_world(self, size: int) -> None:
        """Checks that need the world size: the server must be one of the ranks, and there
        are at most as many servers as ranks."""
        if not 0 <= self.server_rank < size:
            raise ConfigError(f"server_rank must be in [0, {size}) for a job of {size} ranks, "
                              f"got {self.server_rank}{self.env_note('server_rank')}",
                              "server_rank")
        self._check_servers(size)

    def _check_servers(self, size: int) -> None:
        if self.servers != "auto" and self.servers > size:
            raise ConfigError(f"servers must be an integer in 1..{size} (the ranks of the "
                              f"exchange) or 'auto', got {self.servers}"
                              f"{self.env_note('servers')}",
                              "servers")

    def servers_for(self, size: int, compressed_numel: int) -> int:
        """The number of server shards for ``size`` ranks: ``servers``, or for ``"auto"``
        ``min(size, compressed_numel // AUTO_MIN_SHARD)`` from 3 ranks up (at 2, one server
        already moves as many bytes as two), and at least 1."""
        self._check_servers(size)
        if self.servers != "auto":
            return self.servers
        if size < 3:
            return 1
        return max(1, min(size, compressed_numel // AUTO_MIN_SHARD))

    def for_ranks(self, ranks: Sequence[int]) -> "SlimConfig":
        """The config of an exchange among the job ranks ``ranks`` (a process set, in order),
        which numbers its ranks by their position there: ``server_rank``, a job rank, must be one
        of them and becomes its position."""
        ranks = list(ranks)
        if self.server_rank not in ranks:
            raise ConfigError(f"server_rank must be a rank of the process set {ranks} (a job "
                              f"rank), got {self.server_rank}{self.env_note('server_rank')}",
                              "server_rank")
        self._check_servers(len(ranks))
        return self.replaced(server_rank=ranks.index(self.server_rank))

    def replaced(self, **fields: Any) -> "SlimConfig":
        """A copy with ``fields`` changed (validated again), keeping where each keyword came
        from and what the handshake compares beside the fields, which ``dataclasses.replace``
        drops: ``adam_exchange`` resolved once the optimizer is known, an elastic shrink's
        ``servers``, a host exchange's inner settings."""
        out = dataclasses.replace(self, **fields)
        for hidden in ("_env_sources", "_agreed", "_given"):
            object.__setattr__(out, hidden, getattr(self, hidden, {}))
        return out

    def describe_sources(self) -> str:
        """Every setting in force with where it came from (``keyword``, ``HVD_SLIM_X``, a mode's
        defaults, or ``default``), for the log line rank 0 writes when an optimizer is built."""
        env, given = getattr(self, "_env_sources", {}), getattr(self, "_given", ())
        modes = self.mode_sources()
        parts = []
        for name, value in self.effective_dict().items():
            source = env.get(name) or ("keyword" if name in given else
                                       modes.get(name, "default"))
            parts.append(f"{name}={value!r} ({source})")
        return ", ".join(parts)

    @property
    def sparse_rounds(self) -> bool:
        """Local steps over a sparse exchange: SparseLoCo's defaults and outer step apply."""
        return self.local_steps > 1 and self.density < 1.0

    def _mode_fields(self, table: Mapping[str, Any], pull_ratio: float) -> Dict[str, Any]:
        """``table``'s values, and a pull ``pull_ratio`` times the push density, for the
        keywords neither passed nor set by a variable."""
        given = getattr(self, "_given", ())
        out = {k: v for k, v in table.items() if k not in given}
        if "pull_density" not in given:
            out["pull_density"] = min(1.0, pull_ratio * out.get("density", self.density))
        return out

    def update_defaults(self) -> Dict[str, Any]:
        """The update exchange's defaults (``UPDATE_DEFAULTS``, a pull ``UPDATE_PULL_RATIO``
        times the push): what :meth:`replaced` applies once ``adam_exchange`` resolves to
        "update"; at ``value_bits=1``, :meth:`sign_defaults` instead (signs of Adam's update
        are that mode's point)."""
        if self.value_bits == 1:
            return self.sign_defaults()
        return self._mode_fields(UPDATE_DEFAULTS, UPDATE_PULL_RATIO)

    def sign_defaults(self) -> Dict[str, Any]:
        """``value_bits=1``'s defaults (``SIGN_DEFAULTS``, a pull ``SIGN_PULL_RATIO`` times the
        push, where the push is every coordinate), which
        :func:`~hvd_slim.config.env.resolve_config` applies; else nothing. (Signs of a slice,
        a density set below 1.0, keep the default pull, :func:`default_pull_density`.)"""
        if self.value_bits != 1:
            return {}
        out = self._mode_fields(SIGN_DEFAULTS, SIGN_PULL_RATIO)
        if out.get("density", self.density) < 1.0:
            out.pop("pull_density", None)
        return out

    def local_defaults(self) -> Dict[str, Any]:
        """The local-steps defaults (``LOCAL_DEFAULTS``, a pull ``LOCAL_PULL_RATIO`` times the
        push) for :attr:`sparse_rounds` (a density below 1.0 can only be set, or be the default;
        1.0 is DiLoCo's dense rounds); else nothing."""
        if not self.sparse_rounds:
            return {}
        out = self._mode_fields(LOCAL_DEFAULTS, LOCAL_PULL_RATIO)
        if self.senders_ruled_out():   # the user's op, pull or hierarchical rules it out
            out.pop("sparse_average", None)
        if "warmup_settle" in out:   # a warm-up the user's settings turned off has no end
            rest = {k: v for k, v in out.items() if k != "warmup_settle"}
            if dataclasses.replace(self, **rest).effective_warmup_decay_steps == 0:
                del out["warmup_settle"]
        return out

    def senders_ruled_out(self) -> str:
        """Why ``sparse_average="senders"`` cannot apply under these settings ("" when it
        can): it needs op Average, the slim pull, and no host aggregation (which hides who
        sent a coordinate)."""
        if self.op != "average":
            return "op is not Average"
        if self.pull != "slim":
            return f"pull={self.pull!r} (the exact union)"
        if self.hierarchical:
            return "hierarchical=True (a host's aggregate hides which ranks sent)"
        return ""

    def mode_sources(self) -> Dict[str, str]:
        """The settings taken from a mode's defaults, each with the mode's name: the update
        exchange's (``adam_exchange`` resolved to "update"), the local steps' or
        ``value_bits=1``'s (which the update exchange's give way to)."""
        if self.value_bits == 1:
            return dict.fromkeys(self.sign_defaults(), "value_bits=1 default")
        if self.adam_exchange == "update":
            return dict.fromkeys(self.update_defaults(), "update default")
        if self.sparse_rounds:
            return dict.fromkeys(self.local_defaults(), "local-steps default")
        return {}

    def env_note(self, name: str) -> str:
        """`` (from environment variable HVD_SLIM_X)`` when ``name`` came from the environment."""
        var = getattr(self, "_env_sources", {}).get(name)
        return f" (from environment variable {var})" if var else ""

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def effective_dict(self) -> Dict[str, Any]:
        """:meth:`to_dict` with every automatic field (None) replaced by the value in force, the
        warm-up's start density by None when there is no decay: what a checkpoint compares, so a
        changed default can never resume silently."""
        out = self.to_dict()
        decay = self.effective_warmup_decay_steps
        out.update(pull_density=self.effective_pull_density, warmup_decay_steps=decay,
                   pull_value_bits=self.effective_pull_value_bits,
                   warmup_start_density=self.effective_warmup_start_density if decay else None)
        return out

    def shared_dict(self) -> Dict[str, Any]:
        """The settings every rank must agree on (all but the per-rank ``LOCAL_FIELDS``), with
        automatic fields resolved: ranks that differ only in spelling a default agree; and any
        settings held outside the config that the handshake compares too (:meth:`agreeing`)."""
        out = {k: v for k, v in self.effective_dict().items() if k not in LOCAL_FIELDS}
        out.update(getattr(self, "_agreed", {}))
        return out

    def agreeing(self, **extra: str) -> "SlimConfig":
        """A copy whose handshake also compares ``extra``: descriptions of settings that are
        objects, not config values (the outer optimizer of ``local_steps``). Checkpoints do not
        compare them, so they may change on resume."""
        out = self.replaced()
        object.__setattr__(out, "_agreed", dict(getattr(self, "_agreed", {}), **extra))
        return out

    def digest(self) -> str:
        """A short hash of the shared fields, equal on ranks that agree on the config."""
        text = repr(sorted(self.shared_dict().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SlimConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown Slim-DP config keys {sorted(unknown)}")
        return cls(**dict(d))
