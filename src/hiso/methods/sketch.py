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
   rounds rebuilds bit for bit from the log. The downlink is that log (B K scalars a missed
   round): float32 costs 4 B K bytes a record, int8 4 + B K, and the low-bit dtypes
   (``--scalar-dtype int4 | int2 | sign``, :data:`hiso.core.scalars.LOWBIT_DTYPES`) 4 +
   ceil(B K b / 8): the server re-quantises its mean with one scale a record (``sign``: the
   scaled sign of the mean, signSGD with majority vote's server step with an l1 scale).

Where the pieces come from: Ferret (Shu et al., ICML 2025, arXiv 2409.06277) projects a
first-order local update on K seeded directions per block and sends K floats; FeedSign (Cai et
al., arXiv 2501.17610) sends one bit per zeroth-order step with a majority vote; signSGD with
majority vote (Bernstein et al., ICLR 2019) the sign of a first-order gradient. This method
sends b bits of Ferret's projections. With b = 1 the server's mean of scaled signs is not the
majority vote: each client's bit is weighted by its own block scale (a client with a larger
update counts more), which keeps the step's size without a server learning rate to tune; FZOO's
normalised estimator (Dang et al., 2025) is the zeroth-order counterpart of the same idea.

No error feedback. EF-SGD (Karimireddy et al. 2019) keeps the compression residual e_i on the
client and adds it to its next update; it needs a contractive compressor. The whole compressor
here is not: the random projection's error alone is E||(1/K) V V^T x - x||^2 = (d/K - 1) ||x||^2
(d/K ~ 226 on the MNIST CNN at K = 128), so feeding it back grows without bound. Feeding back the
quantiser's error alone, e = (1/K) sum_k (p_k - q_k) v_k (d values a client keeps), fails the
same way: next round's directions are fresh, so e re-enters through a projection whose error is
d/K times its size. Measured (``bench/sketch_ef.py``, MNIST, 20 rounds, lr 0.01): eval loss 2.18
without EF, 2.31 (chance) with it. EF would need directions that persist between a client's rounds (a
fixed pool of seeds, as FedKSeed's), where the residual stays K numbers in sketch space.

Even then, two costs remain. Under client sampling (m of M a round) a client's residual waits
M/m rounds on average (8 on MNIST's 64 / 8) before it is added, at a model the run has since
left (stale compensation), and a client never sampled again carries it away. And a residual is
state outside the log: it must stay the client's own (never in the replicated state, so the
server and ``hiso rebuild`` are unchanged), yet resume after SIGKILL and a restarted Flower node
would lose it unless each client checkpoints it. So the client stays stateless here (its whole
state is its replica, as every scalar method's). The quantiser rounds to nearest (no stochastic
rounding: the codes are a pure function of the update), so its error is biased, at 1 bit most
(the scaled sign); the server's mean over m clients dilutes that bias but does not remove it.

Bytes a round against DeComFL at P = 5 in float32 (20 bytes of scalars an uplink and a record):
B = 1, K = 128, b = 1 with ``--scalar-dtype sign`` is 4 + 16 = 20 bytes each way (K = 32, b = 4
with int4 too); with the log in float32 a record costs 512 bytes, and a client sampled one
round in eight downloads about eight records per answer, so the downlink, not the uplink, sets
the bytes (``hiso compare``'s byte columns are the encoded messages' lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..core.scalars import CODE_BITS, quantize_rows
from .ferret import Ferret, FerretResult
from .ferret import local_update as ferret_update

DEFAULT_BITS = 1


@dataclass(frozen=True)
class Sketch(Ferret):
    """Ferret's local SGD and fold, b-bit codes of its projections on the uplink (see the
    module's docstring). Its options are Ferret's and ``sketch_bits``, b in (1, 2, 4, 8)."""

    sketch_bits: int = field(default=DEFAULT_BITS, metadata={"help": (
        "sketch: b, the bits of each of Ferret's projections on the uplink, one scale per block (1: the scaled "
        "sign; 2, 4, 8: a symmetric uniform grid; K and B are ferret_k and ferret_blocks)")})

    display: ClassVar[str] = "Sketch"
    uplink: ClassVar[str] = "codes"
    can: ClassVar[frozenset] = frozenset({"robust", "weighted", "backprop", "int8", "lowbit", "lr_decay", "grad_clip"})
    flags: ClassVar[str] = "sketch's"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.sketch_bits, bool) or self.sketch_bits not in CODE_BITS:
            raise ValueError(f"sketch_bits must be one of {', '.join(map(str, CODE_BITS))}, got {self.sketch_bits!r}")

    @property
    def bits(self) -> int:
        """b, what the ``codes`` uplink reads (:func:`hiso.core.uplink.uplink_codec`)."""
        return self.sketch_bits

    def local_update(self, state, perturber, loss_fn, batches, seeds):
        res = ferret_update(state, loss_fn, batches, seeds)
        return FerretResult(quantize_rows(res.scalars, self.bits), res.loss, res.work)
