"""Variants of HiSo/DeComFL and other published methods, built on the core's seeds, directions,
history and messages.

The core (:mod:`hiso.core`) is the scalar-only protocol itself. Here are the rules that change
what a round computes without changing that protocol's shape: FeedSign's sign votes
(``feedsign.py``), Ferret's projected first-order update (``ferret.py``), server momentum
(``momentum.py``), the step normalisation (``stepnorm.py``) and client-level differential
privacy (``privacy.py``) and secure aggregation's integer grid (``secagg.py``): a field of :class:`~hiso.core.config.ZOConfig` names each, and the
core's fold, estimator, server or client calls its rule. A method with its own replica, wire
and log is built on the core here too: FedKSeed's seed pool (``fedkseed.py``; its server and
client sides of a round, ``fedkseed_rounds.py``).

Every built-in method is one class on the contract, named here (``hiso.methods.FedAvg``): HiSo
(``hiso_method.py``: :class:`HiSo`, whose stage keeps H), DeComFL (``decomfl.py``), FeedSign,
FedKSeed's options (``fedkseed_method.py``), Ferret, the low-bit sketch and FedKRSO (their
options ``ferret_k``, ``ferret_blocks``, ``server_lr`` and ``sketch_bits`` their fields), greedy,
ConMeZO, and the full-model baselines (``fullmodel.py``: FedZO, FedAvg, FedAdam, FedYogi,
FedAdagrad, their server step, moments and wire format their fields).

Nothing is imported here until asked (``hiso.methods.HiSo``), so importing one method costs only
that method.
"""

_EXPORTS = {"HiSo": "hiso.methods.hiso_method", "DeComFL": "hiso.methods.decomfl", "FeedSign": "hiso.methods.feedsign",
            "Ferret": "hiso.methods.ferret", "FedKSeed": "hiso.methods.fedkseed_method", "Sketch": "hiso.methods.sketch",
            "FedKRSO": "hiso.methods.fedkrso", "Greedy": "hiso.methods.greedy", "ConMeZO": "hiso.methods.conmezo",
            "FedZO": "hiso.methods.fullmodel", "FedAvg": "hiso.methods.fullmodel", "FedAdam": "hiso.methods.fullmodel",
            "FedYogi": "hiso.methods.fullmodel", "FedAdagrad": "hiso.methods.fullmodel"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hiso.methods' has no attribute {name!r}")
