"""Low-bit seeded sketches of a first-order local update: Ferret's rounds at a fraction of its bytes.

Round r, client i, from x_r (everything as :mod:`hiso.methods.ferret` up to step 3):

1. ``steps`` SGD steps with backpropagation (client lr eta): Delta_i = x_r - x_{r,steps}.
2. The trainable tensors form B contiguous blocks (Ferret's :func:`~hiso.methods.ferret.blocks_of`);
   block b gets K seeded directions v_{b,k} (the run's direction family, seeds derived per
   round like every method's; the record's (tau, P) is (B, K)); p_{b,k} = <Delta_i|_b, v_{b,k}>.
3. Each block's K projections are quantised to b bits with one scale for the block
   (:func:`hiso.core.scalars.row_codes`):

   * b = 1: q_{b,k} = s_b sign(p_{b,k}), s_b = mean_k |p_{b,k}|: the scaled sign of signSGD
     (Bernstein et al., ICML 2018, "signSGD: compressed optimisation for non-convex problems")
     with the l1 scale of EF-SGD (Karimireddy et al., ICML 2019, "Error feedback fixes SignSGD
     and other gradient compression schemes"), so a block's step keeps its update's size;
   * b = 2, 4, 8: q_{b,k} = c s_b, c = rint(p / s_b) in [-L, L], L = 2^(b-1) - 1, s_b =
     max_k |p_{b,k}| / L (a symmetric uniform grid; b = 2 is ternary {-s, 0, s}).

   The client uploads the codes and the B scales (``uplink = "codes"``: 4 B + ceil(B K b / 8)
   bytes, plus the loss; :func:`hiso.core.scalars.encode_codes`).
4. The server decodes the q_i (exact float32 values), combines them with the run's rule (the
   mean; weighted, median or trimmed mean where asked), rounds the result to the run's scalar
   dtype once and logs it; every replica folds it with Ferret's step,
   x <- x - server_lr (1/K) sum_k qbar_{b,k} v_{b,k}, so a replica that missed any number of
   rounds rebuilds bit for bit from the log (the downlink is the history in the scalar dtype,
   as for every scalar method: B K scalars a missed round; int8 makes it 4 + B K bytes).

Where the pieces come from: Ferret (Shu et al., ICML 2025, arXiv 2409.06277) projects a
first-order local update on K seeded directions per block and sends K floats; FeedSign (Cai et
al., arXiv 2501.17610) sends one bit per zeroth-order step with a majority vote; signSGD with
majority vote (Bernstein et al., ICLR 2019) the sign of a first-order gradient. This method
sends b bits of Ferret's projections. With b = 1 the server's mean of scaled signs is not the
majority vote: each client's bit is weighted by its own block scale (a client with a larger
update counts more), which keeps the step's size without a server learning rate to tune; FZOO's
normalised estimator (Dang et al., 2025) is the zeroth-order counterpart of the same idea.

No error feedback. EF-SGD keeps the compression residual e_i on the client and adds it to its
next update. Here the compressor is a random projection on K << d directions followed by the
quantiser; the projection's error is not contractive (E||(1/K) V V^T x - x||^2 = (d/K - 1)
||x||^2 > ||x||^2), so feeding it back diverges, and the quantiser's error alone lives on this
round's directions and must be lifted back to d values to be added later. Under client
sampling (m of M each round) a client's residual would also be M/m rounds stale on average when
it is used, computed at a model the run has since left; and a residual is client state outside
the log, so rebuild, resume after SIGKILL and a restarted Flower client would lose it. We
therefore keep the client stateless (its whole state is the replica, as every scalar method's)
and leave error feedback for a measurement with full participation.

Bytes a round (MNIST's default P = 5 DeComFL, float32: 20 bytes of scalars an uplink): B = 1,
K = 128, b = 1 is 4 + 16 = 20 bytes; the downlink's history costs K scalars a missed round
(512 bytes in float32, 132 in int8) against DeComFL's 20, so count both (``hiso compare``'s
byte columns are the encoded messages' lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.scalars import CODE_BITS, quantize_rows
from .ferret import FerretConfig, FerretResult
from .ferret import local_update as ferret_update

DEFAULT_BITS = 1


@dataclass(frozen=True)
class SketchConfig(FerretConfig):
    """Ferret's local SGD and fold, b-bit codes of its projections on the uplink (see the
    module's docstring). steps, server_lr, blocks: Ferret's; bits: b in (1, 2, 4, 8)."""

    bits: int = DEFAULT_BITS
    uplink = "codes"
    legacy_key = None  # a new method: its class and fields name it in the fingerprint

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in CODE_BITS:
            raise ValueError(f"sketch bits must be one of {', '.join(map(str, CODE_BITS))}, got {self.bits!r}")

    def local_update(self, state, perturber, loss_fn, batches, seeds):
        res = ferret_update(state, loss_fn, batches, seeds)
        return FerretResult(quantize_rows(res.scalars, self.bits), res.loss, res.work)
