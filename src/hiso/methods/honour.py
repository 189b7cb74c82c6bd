"""Whether a method's construction honours the capabilities its options need: each option a run
sets that needs a capability must reach what the run computes, or the run is refused.

A method's ``can`` (:mod:`hiso.methods.registry`) is a declaration: the registry refuses an
option whose capability is not declared, but a declared one could still be dropped where the
method is built (``RunConfig.zo()``'s Ferret branch builds its ZOConfig without ``dp``, and a
user's ``stages`` may leave out momentum), so the run would compute as without the option while
config.json and summary.json say it had it. :func:`unhonoured` checks, after the ZOConfig is
built, that each such option reached it (and the fold's chain, and the server's rule), for
every built-in and user's method alike.

What it cannot see: a method whose ``apply_`` folds every record itself (the chain's stages
then never run) or whose ``local_update`` ignores a field it was given.
"""

from __future__ import annotations

import numpy as np

from ..core.chain import stages_for
from ..core.method import Method

# answers whose mean, median and trimmed mean differ in every entry (sign included), and weights
# that move the mean: a combine that reads the rule or the weights gives another aggregate
_PROBE = np.array([[-3.0, 0.5], [-1.0, 0.25], [0.0, 1.0], [0.125, 2.0], [40.0, -50.0]])[:, None, :]
_WEIGHTS = np.array([8.0, 1.0, 1.0, 1.0, 0.5])


def _combines_own_way(method) -> bool:
    return method is not None and type(method).combine is not Method.combine


def _reacts(method, rule: str, trim: float, weights: bool) -> bool:
    """Whether ``method.combine`` gives another aggregate under ``rule`` (and the weights) than
    the plain mean of the probe answers."""
    plain = np.asarray(method.combine(_PROBE, np.ones(len(_PROBE)), "mean", trim), dtype=np.float64)
    w = _WEIGHTS if weights else np.ones(len(_PROBE))
    return not np.array_equal(np.asarray(method.combine(_PROBE, w, rule, trim), dtype=np.float64), plain)


def unhonoured(cfg, zo) -> tuple[str, str, str] | None:
    """(capability, option, what happened to it) for the first option of ``cfg`` (a RunConfig)
    that needs a capability and does not reach ``zo`` (its ZOConfig), or None: all reach it."""
    m = zo.method
    chain = stages_for(zo)
    checks = (
        ("dp", "dp_clip", cfg.dp_clip is not None,
         lambda: zo.dp is not None and (zo.dp.clip, zo.dp.noise_multiplier, zo.dp.mode)
         == (cfg.dp_clip, cfg.dp_noise, cfg.dp_mode), "does not reach the ZOConfig the method builds"),
        ("dp", "dp_mode central", cfg.dp_clip is not None and cfg.dp_mode == "central",
         lambda: not _combines_own_way(m), "replaces the method's own combine by the noised mean"),
        ("secagg", "secagg", cfg.secagg, lambda: not _combines_own_way(m),
         "gives the server only the sum, so the method's own combine would not run"),
        ("momentum", "momentum", cfg.momentum is not None,
         lambda: zo.momentum is not None and zo.momentum.beta == cfg.momentum and zo.momentum in chain,
         "is not a stage of the fold the method builds"),
        ("step_norm", "step_norm", cfg.step_norm is not None,
         lambda: zo.step_norm is not None and zo.step_norm in chain, "is not a stage of the fold the method builds"),
        ("preconditioner", "HiSo's preconditioner", "preconditioner" in cfg.method.can,
         lambda: zo.precond is not None, "does not reach the ZOConfig the method builds"),
        ("lr_decay", "lr_decay", cfg.lr_decay is not None, lambda: zo.lr_decay == cfg.lr_decay,
         "does not reach the ZOConfig the method builds"),
        ("grad_clip", "grad_clip", cfg.grad_clip is not None,
         lambda: m is not None and getattr(m, "grad_clip", None) == cfg.grad_clip,
         "does not reach the method's grad_clip field"),
        ("int8/lowbit", f"scalar_dtype {cfg.scalar_dtype}", cfg.scalar_dtype != "float32",
         lambda: zo.scalar_dtype == cfg.scalar_dtype, "does not reach the ZOConfig the method builds"),
        ("structured", f"directions {cfg.direction_spec}", True, lambda: zo.directions == cfg.direction_spec,
         "does not reach the ZOConfig the method builds"),
        ("robust", f"aggregate {cfg.aggregate}", cfg.aggregate != "mean" and _combines_own_way(m),
         lambda: _reacts(m, cfg.aggregate, cfg.trim, False), "is ignored by the method's own combine"),
        ("weighted", "weighted", cfg.weighted and _combines_own_way(m),
         lambda: _reacts(m, "mean", cfg.trim, True), "is ignored by the method's own combine"),
    )
    for cap, option, given, holds, what in checks:
        if given and not holds():
            return cap, option, what
    return None
