"""Whether a method's construction honours the capabilities its options need: each option a run
sets that needs a capability must reach what the run computes, or the run is refused.

A method's ``can`` (:mod:`hiso.methods.registry`) is a declaration: the registry refuses an
option whose capability is not declared, but a declared one could still be dropped where the
method is built (``RunConfig.zo()``'s Ferret branch builds its ZOConfig without ``dp``, and a
user's ``stages`` may leave out momentum), so the run would compute as without the option while
config.json and summary.json say it had it. :func:`unhonoured` checks, after the ZOConfig is
built, that each such option reached it (and the fold's chain, and the server's rule), for
every built-in and user's method alike.

A method whose ``apply_`` folds records itself may never run the chain's stages: its fold is
probed (:func:`_fold_reads`: three records folded into a small model with the option and
without) and must give another model with ``momentum``, ``step_norm`` and ``lr_decay`` (the
last may instead be read by the method's own ``local_update``, the client's steps). Local DP
noises every scalar of an answer, so the method's uplink codec must carry a dense answer
(:func:`_carries_noise`; greedy's one-choice-a-row codec cannot).

What it cannot see: a method whose own ``local_update`` ignores a field it was given.
"""

from __future__ import annotations

import numpy as np

from ..core.chain import stages_of
from ..core.method import Method

# answers whose mean, median and trimmed mean differ in every entry (sign included), and weights
# that move the mean: a combine that reads the rule or the weights gives another aggregate
_PROBE = np.array([[-3.0, 0.5], [-1.0, 0.25], [0.0, 1.0], [0.125, 2.0], [40.0, -50.0]])[:, None, :]
_WEIGHTS = np.array([8.0, 1.0, 1.0, 1.0, 0.5])


def _combines_own_way(method) -> bool:
    return method is not None and type(method).combine is not Method.combine


def _folds_own_way(method) -> bool:
    return method is not None and type(method).apply_ is not Method.apply_


def _own_local_update(method) -> bool:
    return method is not None and type(method).local_update is not Method.local_update


def _probe_fold(zo) -> list:
    """The parameters after each of three records folded (``ModelState.apply``) into a 2 x 3
    linear model of fixed weights under ``zo``."""
    import torch

    from ..core.history import RoundRecord
    from ..core.seeds import round_seeds
    from ..core.state import ModelState
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1.0, 1.0, 6).reshape(2, 3))
        model.bias.copy_(torch.tensor([0.5, -0.25]))
    state, (tau, P), out = ModelState(model, zo, run_seed=0), zo.shape, []
    for r in range(3):
        scalars = (np.arange(tau * P, dtype=np.float32).reshape(tau, P) % 3 - 1.25) * (r + 1)
        state.apply(RoundRecord(r, round_seeds(0, r, 0, tau, P), scalars, (0,)))
        out.append([p.detach().clone() for p in state.params])
    return out


def _fold_reads(zo, without, with_=None) -> bool:
    """Whether the fold of ``zo`` (with ``with_``'s fields, if given) gives another model than
    with ``without``'s fields (dataclasses.replace of zo). A fold the probe cannot run counts as
    reading it (the run's own error will say more)."""
    import dataclasses

    import torch
    try:
        a = _probe_fold(dataclasses.replace(zo, **(with_ or {})))
        b = _probe_fold(dataclasses.replace(zo, **without))
    except Exception:  # noqa: BLE001  (a method the small model does not suit)
        return True
    return any(not torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _carries_noise(zo) -> bool:
    """Whether the method's uplink codec carries an answer with every scalar nonzero (a local DP
    client's noised answer)."""
    from ..core.messages import Wire
    from ..core.uplink import uplink_codec
    tau, P = zo.shape
    codec = uplink_codec(zo.method)
    wire = Wire(tau, P, zo.scalar_dtype, uplink=codec)
    dense = np.linspace(-1.0, 1.0, tau * P, dtype=np.float32).reshape(tau, P) + np.float32(0.125)
    try:
        codec.encode(dense, wire)
    except ValueError:  # (greedy's: "a choice row has more than one nonzero value")
        return False
    return True


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
    chain = list(m.stages(stages_of(zo))) if m is not None else stages_of(zo)
    checks = (
        ("dp", "dp_clip", cfg.dp_clip is not None,
         lambda: zo.dp is not None and (zo.dp.clip, zo.dp.noise_multiplier, zo.dp.mode)
         == (cfg.dp_clip, cfg.dp_noise, cfg.dp_mode), "does not reach the ZOConfig the method builds"),
        ("dp", "dp_mode central", cfg.dp_clip is not None and cfg.dp_mode == "central",
         lambda: not _combines_own_way(m), "replaces the method's own combine by the noised mean"),
        ("secagg", "secagg", cfg.secagg, lambda: not _combines_own_way(m),
         "gives the server only the sum, so the method's own combine would not run"),
        ("dp", "dp_mode local", cfg.dp_clip is not None and cfg.dp_mode == "local", lambda: _carries_noise(zo),
         "noises every scalar of an answer, which the method's uplink cannot carry, so the run would fail at its "
         "first round"),
        ("momentum", "momentum", cfg.momentum is not None,
         lambda: zo.momentum is not None and zo.momentum.beta == cfg.momentum and zo.momentum in chain,
         "is not a stage of the fold the method builds"),
        ("momentum", "momentum", cfg.momentum is not None and _folds_own_way(m),
         lambda: _fold_reads(zo, {"momentum": None}), "is not read by the method's own fold (apply_)"),
        ("step_norm", "step_norm", cfg.step_norm is not None,
         lambda: zo.step_norm is not None and zo.step_norm in chain, "is not a stage of the fold the method builds"),
        ("step_norm", "step_norm", cfg.step_norm is not None and _folds_own_way(m),
         lambda: _fold_reads(zo, {"step_norm": None}), "is not read by the method's own fold (apply_)"),
        ("preconditioner", "HiSo's preconditioner", "preconditioner" in cfg.method.can,
         lambda: zo.precond is not None, "does not reach the ZOConfig the method builds"),
        ("lr_decay", "lr_decay", cfg.lr_decay is not None, lambda: zo.lr_decay == cfg.lr_decay,
         "does not reach the ZOConfig the method builds"),
        ("lr_decay", "lr_decay", cfg.lr_decay is not None and _folds_own_way(m) and not _own_local_update(m),
         lambda: _fold_reads(zo, {"lr_decay": None}, {"lr_decay": 1.0}),
         "is not read by the method's own fold (apply_) nor by a local_update of its own"),
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
            return cap, option, what if ", so the run" in what else what + ", so the run would compute as without it"
    return None
