"""Residuals of 16-bit models are kept in float32 (Bucket.state_dtype): a gradient far below a
bfloat16 residual's spacing would otherwise be rounded away at every step, and what error
feedback promises to send later would be lost."""
import torch

import hvd_slim
from hvd_slim.transport import run_ranks

SMALL = 2.0 ** -8   # below half the spacing of bfloat16 at 1.0 (2**-7)


def test_a_bfloat16_model_loses_no_small_gradient_in_its_residual():
    steps = 400

    def body(rank, tr):
        p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)], transport=tr,
            density=0.02, exploration=0.0, value_bits=16, min_compress_numel=1000,
            warmup_decay_steps=0)
        g = torch.full((5000,), SMALL, dtype=torch.bfloat16)
        g[:100] = 1.0   # these win every selection (ties go to the lowest index)
        for _ in range(steps):
            opt.zero_grad()
            p.grad = g.clone()
            opt.step()
        opt.flush()
        return p.detach().float(), opt._exchange.worker.memory[0].residual.dtype

    for moved, dtype in run_ranks(2, body):
        # every small gradient arrived: steps * 2**-8 = 1.5625 (exact in bfloat16)
        assert torch.equal(moved[100:], torch.full((4900,), -steps * SMALL)), moved[100:]
        assert dtype == torch.float32
