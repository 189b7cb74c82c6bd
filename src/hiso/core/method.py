"""The methods contract: the hooks a round of the seed-and-scalar protocol calls.

The core (estimator, fold, server, wire) never imports a method. A method reaches it as one
object, :class:`Method`, held in :class:`~hiso.core.config.ZOConfig` (``method``), whose hooks
the core calls at fixed points of a round; each default is DeComFL's rule, so a method overrides
only what it changes (HiSo, :class:`hiso.methods.HiSo`, only ``stages``: it adds H's):

==================  ==========================================================================
hook                called by, and when
==================  ==========================================================================
``batches``         the client: how many minibatches a round's answer takes
``local_update``    the client: its answer's scalars from x_r, the batches and the round's
                    seeds (None: the ZO estimate of :mod:`hiso.core.estimator`)
``step_scalars``    the ZO estimate: what a client keeps of one local step's P scalars (it
                    steps with them and sends them; FeedSign: their signs)
``combine``         the server: the answers (n, tau, P) to the logged aggregate, after the
                    robust rule (FeedSign: the majority vote)
``apply_``          every replica: fold one logged record into the state (None: the chain
                    of :mod:`hiso.core.chain`, the default fold)
``stages``          every replica, once: the chain's stages (step-size stages, then the step
                    stage); a method adds a stage with state of its own or replaces the step
                    (its state is saved in model.pt and checkpoint.pt, sent in snapshots)
``record_shape``    the run's configuration, once: the (tau, P) of a round's seeds and scalars
                    (None: the run's local steps and perturbations, the ZO estimate's; Ferret's
                    projections: its (B, K))
``uplink``          the wire: a codec (:mod:`hiso.core.uplink`) for the answers (FeedSign's
                    one-bit signs are its own), or the name of a built-in one:
                    ``"scalars"`` (the run's scalar dtype) or ``"codes"`` (b-bit codes with
                    a scale per row of the record, b the method's ``bits`` field)
==================  ==========================================================================

Everything a method computes must be a pure function of what the protocol gives it (x_r, the
round's seeds, the logged record, its batches): replicas fold the same records into the same
state, bit for bit. Options, capabilities and the command line are the registry's
(:mod:`hiso.methods.registry`): a method there names the :class:`Method` it runs.

A method is a frozen dataclass: its class and fields are part of the configuration fingerprint
that peers compare when they join (:func:`hiso.core.join.config_fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from .aggregate import combine
from .uplink import uplink_codec

if TYPE_CHECKING:
    from .history import RoundRecord


class Replica(Protocol):
    """What a hook is handed as ``state``: a replica, :class:`hiso.core.state.ModelState` (built
    from the :class:`~hiso.core.config.ZOConfig` that holds the method, so described here, not imported)."""

    model: Any  # the model, x_r
    params: list  # its trainable tensors, in protocol order
    slots: dict  # the fold's stage states by stage name
    round: int  # r: the round whose starting point the replica holds
    cfg: Any  # the run's ZOConfig
    gen: Any  # the direction generator (hiso.core.directions), bound to the run


@dataclass(frozen=True)
class Method:
    """DeComFL's round: the ZO estimate on the client, the (robust) mean on the server, the
    chain fold on every replica. Subclass it and override a hook to make another method."""

    uplink: ClassVar[Any] = "scalars"  # "codes" (the method has ``bits``) or a codec (hiso.core.uplink)

    def batches(self, cfg) -> int:
        """Minibatches a client's answer takes (one per local step)."""
        return cfg.local_steps

    def local_update(self, state: Replica, perturber, loss_fn, batches: list, seeds: np.ndarray):
        """The client's answer (a :class:`~hiso.core.estimator.LocalResult`-like object with
        ``scalars``, ``loss`` and ``work``), or None for the ZO estimate."""
        return None

    def step_scalars(self, g: np.ndarray) -> np.ndarray:
        """What a client keeps of one local step's (P,) float32 scalars."""
        return g

    def combine(self, g: np.ndarray, w: np.ndarray, rule: str, trim: float) -> np.ndarray:
        """The answers ``g`` (n, tau, P) float64 with weights ``w`` to the aggregate (float64)."""
        return combine(g, w, rule, trim)

    def apply_(self, state: Replica, record: "RoundRecord") -> Any:
        """Fold ``record`` into ``state`` and return True, or return None for the chain fold."""
        return None

    def stages(self, chain: list) -> list:
        """The fold's stages in chain order (:mod:`hiso.core.chain`): the run's own by default.
        Each stage with a ``name`` keeps ``init(params)``'s value (a tensor or a list of tensors)
        as the replica's state under that name."""
        return chain

    def record_shape(self) -> tuple[int, int] | None:
        """A round's (tau, P) when the method sends other numbers than the ZO estimate's (None:
        the run's local steps and perturbations)."""
        return None


DECOMFL = Method()


def check_method(method: Any) -> Method:
    """``method`` if it is a :class:`Method` (one-line error otherwise)."""
    if not isinstance(method, Method):
        raise TypeError(f"a method must be a hiso.core.method.Method, got {type(method).__name__}")
    uplink_codec(method)
    return method
