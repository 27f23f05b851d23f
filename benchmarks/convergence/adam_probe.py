"""A one-process probe of compression schemes for AdamW on the byte-level language model.

N workers are simulated in one process on one set of parameters (the replicas of a real job are
identical, so one copy stands for all): each draws its own batches, and the scheme decides what
each worker sends, what the server makes of it and what every replica applies. It is a
screening tool for the mechanism behind hvd_slim's Adam path (issue "Transformers without
loss"), not hvd_slim itself: there is no wire, and bytes are counted from a formula (values at
their bits, Elias-Fano indices at ``2 + ceil(log2(d/k))`` bits a coordinate, explored indices
free, as hvd_slim's wire counts them).

Schemes (``--scheme``):

- ``dense``: AdamW on the average gradient;
- ``grad``: error feedback on raw gradients, the delivered average into one AdamW;
- ``update``: each worker's own AdamW moments on its gradient; error feedback on its update
  ``lr * m_hat / (sqrt(v_hat) + eps)``; the delivered average applied as a parameter delta,
  decoupled weight decay alike on every replica.

    python -m benchmarks.convergence.adam_probe --scheme update --density 0.02 --steps 2000
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Dict, List, Optional

import torch

from .lm import ByteLM, load_corpus, lm_loss, validation_windows

SMALL = 4096   # tensors under this many elements are averaged dense (hvd_slim's default)


def two_bit_scale(x: torch.Tensor, rule: str) -> float:
    """The 2-bit coding's scale ``s`` (levels +-0.5 s and +-1.5 s, nearest, clipped at 1.5 s):
    "max" (hvd_slim's: the largest magnitude lands on 1.5 s, nothing is clipped), "mean" (the
    values' mean magnitude, EF-signSGD's), or "mse" (of a geometric grid below "max", the one
    with the least squared error)."""
    amax = float(x.abs().max())
    if rule == "max":
        return amax / 1.5
    if rule == "mean":
        return float(x.abs().mean())
    best, out = None, amax / 1.5
    for j in range(16):
        sc = amax / 1.5 * 2.0 ** (-j / 4)
        err = float(((torch.floor(x / sc).clamp_(-2, 1) + 0.5) * sc - x).pow(2).sum())
        if best is None or err < best:
            best, out = err, sc
    return out


def quantize(x: torch.Tensor, bits: int, rule: str = "max") -> torch.Tensor:
    """What a receiver decodes of ``x`` sent at ``bits`` (hvd_slim's value codings; ``rule``:
    the 2-bit scale's, :func:`two_bit_scale`)."""
    if bits >= 32 or x.numel() == 0:
        return x.clone()
    amax = float(x.abs().max())
    if amax == 0:
        return torch.zeros_like(x)
    if bits == 16:
        return x.to(torch.bfloat16).to(x.dtype)
    if bits == 8:
        e = math.ceil(math.log2(amax / 448.0)) if amax > 0 else 0
        return (x * 2.0 ** -e).to(torch.float8_e4m3fn).to(x.dtype) * 2.0 ** e
    if bits == 4:
        s = amax / 7.0
        return torch.round(x / s).clamp_(-7, 7) * s
    if bits == 1:   # the sign at the values' mean magnitude (EF-signSGD's, 1-bit Adam's)
        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype) * float(x.abs().mean())
    if bits != 2:
        raise ValueError(f"bits must be 1, 2, 4, 8, 16 or at least 32, got {bits}")
    s = two_bit_scale(x, rule)
    return (torch.floor(x / s).clamp_(-2, 1) + 0.5) * s


def index_bits(d: int, k: int) -> float:
    return 0.0 if k == 0 else k * (2 + math.ceil(math.log2(max(d / k, 1.0))))


class Selector:
    """Top-k by magnitude over a flat vector: global, per tensor, or per tile of ``tile``."""

    def __init__(self, sizes: List[int], quota: str, tile: int) -> None:
        self.sizes, self.quota, self.tile = sizes, quota, tile
        self.d = sum(sizes)

    def __call__(self, a: torch.Tensor, density: float) -> torch.Tensor:
        if density >= 1.0:
            return torch.arange(self.d)
        if self.quota == "global":
            k = max(1, round(density * self.d))
            return a.abs().topk(k, sorted=False).indices
        if self.quota == "tensor":
            out, off = [], 0
            for n in self.sizes:
                k = max(1, round(density * n))
                out.append(a[off:off + n].abs().topk(k, sorted=False).indices + off)
                off += n
            return torch.cat(out)
        # tiles of ``tile`` consecutive coordinates, an equal share of each
        t = self.tile
        full = self.d // t * t
        k = max(1, round(density * t))
        tiles = a[:full].abs().view(-1, t).topk(k, dim=1, sorted=False).indices
        idx = (tiles + torch.arange(0, full, t).unsqueeze(1)).flatten()
        if full < self.d:
            rest = a[full:].abs()
            kr = max(1, round(density * rest.numel()))
            idx = torch.cat([idx, rest.topk(kr, sorted=False).indices + full])
        return idx


class Probe:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        torch.manual_seed(args.seed)
        self.model = ByteLM(context=args.context, width=args.width, layers=args.layers,
                            heads=args.heads)
        named = list(self.model.named_parameters())
        self.big = [p for _, p in named if p.numel() >= SMALL]
        self.small = [p for _, p in named if p.numel() < SMALL]
        self.sizes = [p.numel() for p in self.big]
        self.d = sum(self.sizes)
        self.sel = Selector(self.sizes, args.quota, args.tile)
        n = args.workers
        z = lambda: torch.zeros(self.d)   # noqa: E731
        self.resid = [z() for _ in range(n)]
        self.m = [z() for _ in range(n)]
        self.v = [z() for _ in range(n)]
        self.w = [z() for _ in range(n)]   # --v-correct: a slow average of m_hat^2
        self.server = z()
        self.gm, self.gv = z(), z()          # the shared moments (dense, grad schemes)
        self.sm = [torch.zeros_like(p) for p in self.small]
        self.sv = [torch.zeros_like(p) for p in self.small]
        self.bits_push = 0.0
        self.bits_pull = 0.0
        self.gen = torch.Generator().manual_seed(1000 + args.seed)

    def lr(self, t: int) -> float:
        a = self.a
        warm = max(1, int(a.warmup * a.steps))
        if t < warm:
            return a.lr * (t + 1) / warm
        frac = (t - warm) / max(1, a.steps - warm)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def density(self, t: int) -> float:
        """The automatic warm-up: 8x the density, falling geometrically over 1/density steps."""
        a = self.a
        span = math.ceil(1 / a.density) if a.auto_warmup else 0
        if t < a.dense_steps:
            return 1.0
        t -= a.dense_steps
        if t >= span:
            return a.density
        start = min(1.0, 8 * a.density)
        return start * (a.density / start) ** (t / span)

    def adam_dir(self, g, m, v, t, b1, b2, eps):
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
        return (m / bc1) / ((v / bc2).sqrt() + eps)

    def step(self, t: int, grads: List[torch.Tensor], small: List[List[torch.Tensor]]) -> None:
        a, lr = self.a, self.lr(t)
        b1, b2, eps, wd = 0.9, a.beta2, 1e-8, a.wd
        n = a.workers
        with torch.no_grad():
            # the small tensors: exact average, one shared AdamW
            for j, p in enumerate(self.small):
                g = sum(s[j] for s in small) / n
                u = self.adam_dir(g, self.sm[j], self.sv[j], t, b1, b2, eps)
                p.mul_(1 - lr * wd).sub_(u, alpha=lr)
            dens = self.density(t)
            if a.scheme == "dense":
                g = sum(grads) / n
                self.apply(self.adam_dir(g, self.gm, self.gv, t, b1, b2, eps) * lr, lr, wd)
                self.bits_push += 32 * self.d
                self.bits_pull += 32 * self.d
                return
            props = []
            for i in range(n):
                if a.scheme == "grad":
                    u = grads[i]
                elif a.oracle_v:   # diagnostic: each worker's m, the average gradient's v
                    if i == 0:
                        gm = sum(grads) / n
                        self.gv.mul_(b2).addcmul_(gm, gm, value=1 - b2)
                    self.m[i].mul_(b1).add_(grads[i], alpha=1 - b1)
                    u = (self.m[i] / (1 - b1 ** (t + 1))) / \
                        ((self.gv / (1 - b2 ** (t + 1))).sqrt() + eps) * lr
                elif a.v_correct:
                    # The average gradient's second moment estimated from this worker alone:
                    # E[g_i^2]/N for the noise, plus (1 - 1/N) of a slow average of m_hat^2
                    # for the mean's square (m_hat's own noise is ~(1-b1)/(1+b1) of g's).
                    g = grads[i]
                    self.m[i].mul_(b1).add_(g, alpha=1 - b1)
                    self.v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                    mh = self.m[i] / (1 - b1 ** (t + 1))
                    self.w[i].mul_(b2).addcmul_(mh, mh, value=1 - b2)
                    bc2 = 1 - b2 ** (t + 1)
                    vc = (self.v[i] / n + (1 - 1 / n) * self.w[i]) / bc2
                    u = mh / (vc.sqrt() + eps) * lr
                else:
                    u = self.adam_dir(grads[i], self.m[i], self.v[i], t, b1, b2, eps) * lr
                r = self.resid[i]
                r.mul_(a.decay).add_(u)
                props.append(r)
            agg = torch.zeros(self.d)
            count = torch.zeros(self.d)
            shared = None
            if a.shared == "leader" and dens < 1.0:   # one rank's top-k, taken by every rank
                shared = self.sel(props[t % n], dens)
            elif a.shared == "random" and dens < 1.0:   # a seeded draw every rank makes alike
                shared = torch.randperm(self.d, generator=self.gen)[:max(1, round(dens * self.d))]
            elif a.shared == "sum" and dens < 1.0:    # oracle: the top-k of the summed residual
                shared = self.sel(sum(props), dens)
            elif a.shared == "stride" and dens < 1.0:   # every P-th coordinate, in turn
                period = max(1, round(1 / dens))
                shared = torch.arange(t % period, self.d, period)
            for i, r in enumerate(props):
                idx = self.sel(r, dens) if shared is None else shared
                k = idx.numel()
                ke = 0
                if a.explore > 0 and dens < 1.0:
                    ke = round(a.explore * dens * self.d)
                    extra = torch.randint(0, self.d, (ke,), generator=self.gen)
                    if a.explore_bits:   # the explored values coded apart, at their own scale
                        taken = torch.zeros(self.d, dtype=torch.bool)
                        taken[idx] = True
                        extra = torch.unique(extra[~taken[extra]])
                        ev = quantize(r[extra], a.explore_bits, a.scale)
                        r[extra] -= ev
                        agg[extra] += ev
                        count[extra] += 1
                        self.bits_push += ke * a.explore_bits
                        ke = 0
                    else:
                        idx = torch.unique(torch.cat([idx, extra]))
                vals = quantize(r[idx], a.bits, a.scale)
                r[idx] -= vals
                if a.mask and a.scheme == "update":   # momentum masking where sent
                    self.m[i][idx] *= 1 - a.mask
                agg[idx] += vals
                count[idx] += 1
                free = a.shared in FREE   # the receiver knows the same coordinates
                self.bits_push += (k + ke) * min(a.bits, 32) + \
                    (0 if free else index_bits(self.d, k)) if dens < 1.0 else \
                    min(a.bits, 32) * self.d
            if a.sender_mean:
                agg /= count.clamp(min=1)
            else:
                agg /= n
            # A push of every coordinate is pulled whole, unless a slim pull is asked for by a
            # ratio under 1 (a slice of the sum) or at fewer bits (every coordinate's sign, say)
            if a.pull == "union" or (dens >= 1.0 and a.pull_ratio >= 1.0
                                     and a.pull_bits in (0, 32)):
                delivered = agg
                nz = int((count > 0).sum())
                self.bits_pull += nz * 32 + (0 if a.shared in FREE else index_bits(
                    self.d, nz)) if dens < 1.0 else 32 * self.d
            else:
                e = self.server
                e.mul_(a.server_decay).add_(agg)
                pd = min(1.0, dens * a.pull_ratio)
                # a stride push is pulled on its own coordinates, which every rank knows
                stride = a.shared == "stride" and shared is not None
                idx = shared if stride else self.sel(e, pd)
                # the server's own exploration, coded with its core
                if a.pull_explore and a.shared != "stride":
                    extra = torch.randint(0, self.d, (round(a.pull_explore * idx.numel()),),
                                          generator=self.gen)
                    idx = torch.unique(torch.cat([idx, extra]))
                vals = quantize(e[idx], a.pull_bits or a.bits, a.scale)
                e[idx] -= vals
                delivered = torch.zeros(self.d)
                delivered[idx] = vals
                self.bits_pull += idx.numel() * min(a.pull_bits or a.bits, 32) + \
                    (0 if stride else index_bits(self.d, idx.numel()))
            if a.scheme == "grad":
                self.apply(self.adam_dir(delivered, self.gm, self.gv, t, b1, b2, eps) * lr,
                           lr, wd)
            else:
                self.apply(delivered, lr, wd)

    def apply(self, delta: torch.Tensor, lr: float, wd: float) -> None:
        off = 0
        for p in self.big:
            n = p.numel()
            p.mul_(1 - lr * wd).sub_(delta[off:off + n].view_as(p))
            off += n


# Shared selections whose coordinates every rank knows without being sent them.
FREE = ("random", "stride")


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", choices=("dense", "grad", "update"), default="update")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--warmup", type=float, default=0.05)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--bits", type=int, default=32)
    ap.add_argument("--explore", type=float, default=0.0, help="explored share of k")
    ap.add_argument("--explore-bits", type=int, default=0,
                    help="code the explored values apart at these bits (0: with the core)")
    ap.add_argument("--quota", choices=("global", "tensor", "tile"), default="global")
    ap.add_argument("--tile", type=int, default=4096)
    ap.add_argument("--decay", type=float, default=1.0)
    ap.add_argument("--server-decay", type=float, default=1.0)
    ap.add_argument("--pull", choices=("union", "slim"), default="union")
    ap.add_argument("--pull-ratio", type=float, default=2.0)
    ap.add_argument("--pull-bits", type=int, default=0, help="the server slice's bits (0: --bits)")
    ap.add_argument("--pull-explore", type=float, default=0.0,
                    help="the server's explored share of its slice")
    ap.add_argument("--sender-mean", action="store_true")
    ap.add_argument("--shared", choices=("none", "leader", "sum", "random", "stride"),
                    default="none",
                    help="every worker sends the same coordinates: a rotating leader's top-k, "
                         "(oracle) the top-k of the summed residuals, a seeded random draw, or "
                         "every round(1/density)-th coordinate in turn (the last two: indices "
                         "free; with stride a slim pull sends the same coordinates)")
    ap.add_argument("--v-correct", action="store_true",
                    help="estimate the average gradient's second moment locally (update)")
    ap.add_argument("--oracle-v", action="store_true",
                    help="diagnostic: the second moment of the average gradient (update)")
    ap.add_argument("--mask", type=float, default=0.0,
                    help="share of a worker's first moment dropped where it sent (update)")
    ap.add_argument("--dense-steps", type=int, default=0)
    ap.add_argument("--auto-warmup", action="store_true")
    ap.add_argument("--evals", type=int, default=4)
    ap.add_argument("--val-windows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", choices=("max", "mean", "mse"), default="max",
                    help="the 2-bit coding's scale rule (two_bit_scale)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus()
    vx, vy = validation_windows(corpus.val, args.context, args.val_windows)
    probe = Probe(args)
    data = corpus.train
    span = data.numel() - args.context - 2
    gens = [torch.Generator().manual_seed(17 * args.seed + i) for i in range(args.workers)]
    curve = []
    t0 = time.time()

    def evaluate() -> float:
        probe.model.eval()
        tot = 0.0
        with torch.no_grad():
            for i in range(0, len(vx), 64):
                tot += float(lm_loss(probe.model, vx[i:i + 64], vy[i:i + 64])) * \
                    vy[i:i + 64].numel()
        probe.model.train()
        return tot / vy.numel() / math.log(2)

    for t in range(args.steps):
        grads, small = [], []
        for i in range(args.workers):
            starts = torch.randint(0, span, (args.batch,), generator=gens[i])
            chunk = torch.stack([data[s:s + args.context + 1].long() for s in starts.tolist()])
            probe.model.zero_grad(set_to_none=True)
            lm_loss(probe.model, chunk[:, :-1], chunk[:, 1:]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in probe.big]))
            small.append([p.grad.clone() for p in probe.small])
        probe.step(t, grads, small)
        if (t + 1) % max(1, args.steps // args.evals) == 0 or t + 1 == args.steps:
            curve.append((t + 1, evaluate()))
            print(json.dumps({"step": t + 1, "bpb": round(curve[-1][1], 4),
                              "s": round(time.time() - t0, 1)}), flush=True)
    dense_bits = 32.0 * probe.d * args.steps
    out = {"args": vars(args), "params": sum(p.numel() for p in probe.model.parameters()),
           "compressed": probe.d, "curve": curve, "final": curve[-1][1],
           "push_ratio": dense_bits / max(probe.bits_push, 1.0),
           "pull_ratio": dense_bits / max(probe.bits_pull, 1.0),
           "tokens_per_param": args.steps * args.workers * args.batch * args.context /
           sum(p.numel() for p in probe.model.parameters()),
           "seconds": time.time() - t0}
    print(json.dumps({k: out[k] for k in ("final", "push_ratio", "pull_ratio",
                                          "tokens_per_param", "seconds")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
