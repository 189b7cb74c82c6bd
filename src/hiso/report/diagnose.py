"""``hiso diagnose RUN``: what a HiSo run's preconditioner H learned.

H is not stored per round, but every replica can recompute it: the run's x_0 and its
``history.bin`` replayed (as ``hiso rebuild`` does) give H_r at any round r, bit for bit. The
replay stops at ``points`` evenly spaced rounds and records:

* H's quantiles over all coordinates (min, 5 %, 50 %, 95 %, max) and per tensor;
* the effective step size. A HiSo step is ``x -= lr ghat`` with
  ``ghat = H^{-1/2} (1/P) sum_p g_p u_p`` and ``g_p ~ u_p^T H^{-1/2} grad f``, so
  ``E[ghat] = H^{-1} grad f`` (``E[u u^T] = I``): coordinate j moves with step ``lr / H_j``,
  where DeComFL's is ``lr``. Reported: quantiles of lr / H and its mean (the global step).
* the noise-floor level: what H would be if it held no per-coordinate information at all. With
  d >> P, E[ghat_i^2] = S / (P H_i) + (1 - 1/P) (H_i^{-1} grad_i f)^2 where S = (1/P) sum_p g_p^2
  is the round's mean squared scalar, and the first term dominates (see
  :mod:`hiso.core.preconditioner`). The level (:func:`hiso.methods.hiso_method.floor_step_`) is
  H's own moving average (same nu, weights and clipping) fed with the coordinate mean of that
  first term, from the logged scalars alone; a median H that sits on it says H is one global
  step size set by the scalars' power, not a per-coordinate curvature.

For small models (``d <= max_params``, data at hand) H at the last round is set against the
curvature measured with autograd at the final model, on training batches the run never drew
(rounds after its last): a Hutchinson estimate of the Hessian diagonal, mean of
``v * (nabla^2 f v)`` over Rademacher ``v`` (exact for a diagonal Hessian), and the gradient's
second moment ``mean_b g_b^2``. Their Pearson and Spearman correlations with H, over all
coordinates and within each tensor, and per-tensor means side by side, say whether H tracks
curvature per coordinate, per tensor, or only as one global step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)
Q_NAMES = ("min", "p5", "median", "p95", "max")


def _quantiles(x: np.ndarray) -> dict[str, float]:
    return {k: float(v) for k, v in zip(Q_NAMES, np.quantile(x, QUANTILES))}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's correlation)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def correlations(a: np.ndarray, b: np.ndarray) -> dict[str, float | None]:
    """Pearson and Spearman correlation of two vectors (None where one is constant)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return {"pearson": None, "spearman": None}
    return {"pearson": float(np.corrcoef(a, b)[0, 1]),
            "spearman": float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])}


@dataclass
class Curvature:
    hutchinson: list[torch.Tensor]  # per tensor: mean over batches and probes of v * (Hess v)
    grad2: list[torch.Tensor]  # per tensor: mean over batches of g_b ** 2


def measure_curvature(task, model: torch.nn.Module, params: list[torch.Tensor], first_round: int,
                      batches: int = 8, probes: int = 1, batch_size: int = 32, seed: int = 0) -> Curvature:
    """Hutchinson's Hessian diagonal and the gradient's second moment at ``model``'s weights, on
    ``batches`` minibatches of clients 0, 1, ... at rounds ``first_round``, ``first_round + 1``, ...
    (rounds the run never reached, so batches it never drew)."""
    gen = torch.Generator().manual_seed(seed)
    hutch = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    grad2 = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    was_training = model.training
    model.eval()  # dropout off: the measured function is the one the ZO forwards evaluated
    try:
        for b in range(batches):
            batch = task.batch(b % task.num_clients, first_round + b // task.num_clients, 0, batch_size)
            with torch.enable_grad():
                loss = task.loss(model, batch)
                grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
                # a parameter the loss does not depend on has zero gradient and curvature
                used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
                for i, g in enumerate(grads):
                    if g is not None:
                        grad2[i].add_(g.detach().float() ** 2 / batches)
                if not used:
                    continue
                for k in range(probes):
                    vs = [(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p.dtype).to(p.device)
                          for p in params]
                    hv = torch.autograd.grad([grads[i] for i in used], params, grad_outputs=[vs[i] for i in used],
                                             retain_graph=k < probes - 1, allow_unused=True)
                    for v, h, acc in zip(vs, hv, hutch):
                        if h is not None:
                            acc.add_((v * h).detach().float() / (batches * probes))
    finally:
        model.train(was_training)
    return Curvature(hutch, grad2)


def diagnose(run_dir: str | Path, points: int = 20, curvature: str = "auto", max_params: int = 1_000_000,
             batches: int = 8, probes: int = 4, progress: bool = True) -> dict[str, Any]:
    """The numbers of ``hiso diagnose`` for the run in ``run_dir`` (see the module docstring)."""
    from tqdm import tqdm

    from ..methods.hiso_method import floor_step_
    from ..runners.rebuild import start_replica
    from ..runners.runfiles import saved_config

    run_dir = Path(run_dir)
    cfg, info = saved_config(run_dir)
    if "preconditioner" not in cfg.method.can:
        raise ValueError(f"{run_dir} is a {cfg.algorithm} run: it has no preconditioner H to diagnose (hiso runs only)")
    if curvature not in ("auto", "yes", "no"):
        raise ValueError(f"curvature must be auto, yes or no, got {curvature!r}")
    if points < 2:
        raise ValueError(f"points must be >= 2, got {points}")
    state, task, cfg, _, records = start_replica(run_dir)  # on the CPU, whatever device the run used
    R = len(records)
    names = [n for n, _ in state.named]
    lr = cfg.lr
    at = sorted(set(np.linspace(0, R, min(points, R + 1)).round().astype(int).tolist()))
    rounds: list[dict] = []

    pcfg, tau = state.cfg.precond, state.cfg.local_steps
    level = torch.ones(1)  # the noise-floor level, advanced by the core's own block update
    updates = 0

    def snapshot() -> None:
        hs = [h.detach().reshape(-1).numpy().astype(np.float64) for h in state.h]
        allh = np.concatenate(hs)
        lr = state.cfg.lr_at(state.round)  # the round's step size (constant unless lr_decay)
        rounds.append({
            "round": state.round,
            "h": _quantiles(allh),
            "lr": lr,
            "step": {**_quantiles(lr / allh), "mean": float(np.mean(lr / allh))},
            "h_per_tensor_median": {n: float(np.median(h)) for n, h in zip(names, hs)},
            "floor_level": float(level),
        })

    bar = tqdm(total=R, desc="replaying H", unit="round", disable=not progress or None, leave=False)
    for rec in records:
        if state.round in at:
            snapshot()
        inv_mean = float(sum(torch.reciprocal(h.double()).sum() for h in state.h)) / sum(h.numel() for h in state.h)
        for k in range(tau):
            if pcfg.updates_at(k, tau):
                floor_step_(level, rec.scalars[k], inv_mean, pcfg, updates)
                updates += 1
        state.apply(rec)
        bar.update(1)
    bar.close()
    snapshot()
    final = [h.detach().clone() for h in state.h]
    out: dict[str, Any] = {
        "run": str(run_dir), "algorithm": cfg.algorithm, "task": cfg.task, "lr": lr, "rounds": R,
        "parameters": int(sum(h.numel() for h in final)),
        "variant": {**{k: cfg.method_opts[k] for k in ("nu", "h_granularity", "h_stat", "h_bias_correction")},
                    "momentum": cfg.momentum,
                    "lr_decay": cfg.lr_decay, "step_norm": cfg.step_norm, "directions": cfg.direction_spec},
        "effective_step": "lr / H per coordinate (E[ghat] = H^-1 grad f); DeComFL's is lr",
        "over_rounds": rounds,
        "per_tensor": [{"name": n, "numel": int(h.numel()), **_quantiles(h.reshape(-1).double().numpy()),
                        "mean": float(h.double().mean())} for n, h in zip(names, final)],
    }
    model_pt = run_dir / "model.pt"
    if model_pt.is_file():  # the replay is the run's own H, or this says so
        saved = torch.load(model_pt, weights_only=True).get("h")
        out["matches_model_pt"] = saved is not None and saved.keys() == set(names) and all(
            torch.equal(saved[n], h) for n, h in zip(names, final)) and state.round == R
    small = out["parameters"] <= max_params
    if curvature == "yes" or (curvature == "auto" and small):
        cur = measure_curvature(task, state.model, state.params, first_round=R + 1, batches=batches,
                                probes=probes, batch_size=cfg.batch_size, seed=cfg.seed)
        h_all = torch.cat([h.reshape(-1) for h in final]).double().numpy()
        hu_all = torch.cat([c.reshape(-1) for c in cur.hutchinson]).double().numpy()
        g2_all = torch.cat([c.reshape(-1) for c in cur.grad2]).double().numpy()
        out["curvature"] = {
            "batches": batches, "probes": probes,
            "overall": {"hutchinson": correlations(h_all, hu_all), "grad2": correlations(h_all, g2_all)},
            "per_tensor": [{"name": n, "h_mean": float(h.double().mean()), "hutchinson_mean": float(c.double().mean()),
                            "grad2_mean": float(g.double().mean()),
                            "hutchinson": correlations(h.numpy(), c.numpy()), "grad2": correlations(h.numpy(), g.numpy())}
                           for n, h, c, g in zip(names, final, cur.hutchinson, cur.grad2)],
            "across_tensors": {  # one value per tensor: does H's level follow the tensor's curvature?
                "hutchinson": correlations([float(h.double().mean()) for h in final],
                                           [float(c.double().mean()) for c in cur.hutchinson]),
                "grad2": correlations([float(h.double().mean()) for h in final],
                                      [float(c.double().mean()) for c in cur.grad2])},
        }
        out["_arrays"] = {"h": h_all, "hutchinson": hu_all, "grad2": g2_all}
    else:
        out["curvature"] = None
        out["_arrays"] = {"h": torch.cat([h.reshape(-1) for h in final]).double().numpy()}
    return out


def _fmt(c: dict | None) -> str:
    if c is None or c.get("pearson") is None:
        return "n/a"
    return f"Pearson {c['pearson']:+.2f}, Spearman {c['spearman']:+.2f}"


def summary_text(d: dict[str, Any]) -> str:
    """A short text summary of :func:`diagnose`'s numbers."""
    first, last = d["over_rounds"][0], d["over_rounds"][-1]
    h = last["h"]
    lines = [
        f"hiso diagnose {d['run']}: {d['task']}, {d['parameters']:,} trainable numbers, {d['rounds']} rounds, lr {d['lr']:g}",
        "variant: " + ", ".join(f"{k}={v}" for k, v in d["variant"].items()),
        f"H at round {last['round']}: min {h['min']:.3g}, 5% {h['p5']:.3g}, median {h['median']:.3g}, "
        f"95% {h['p95']:.3g}, max {h['max']:.3g} (H_0 = 1); 95%/5% spread {h['p95'] / h['p5']:.2f}",
        f"effective step lr/H: median {last['step']['median']:.3g} (round 0: {first['step']['median']:.3g}), "
        f"mean {last['step']['mean']:.3g}, 5%-95% [{last['step']['p5']:.3g}, {last['step']['p95']:.3g}]",
        "median H over rounds: " + ", ".join(f"r{r['round']} {r['h']['median']:.3g}" for r in d["over_rounds"]),
    ]
    if "floor_level" in last:
        lines.append(
            f"noise-floor level (H's average fed with the scalars' power alone, no per-coordinate information): "
            f"{last['floor_level']:.3g} at round {last['round']}, median H / level "
            f"{last['h']['median'] / last['floor_level']:.2f}; over rounds: "
            + ", ".join(f"r{r['round']} {r['floor_level']:.3g}" for r in d["over_rounds"]))
    if "matches_model_pt" in d:
        lines.append("replayed H equals model.pt's H bit for bit" if d["matches_model_pt"]
                     else "WARNING: replayed H differs from model.pt's (incomplete or foreign history?)")
    tens = sorted(d["per_tensor"], key=lambda t: -t["numel"])[:8]
    lines.append("per tensor (largest first): " + "; ".join(
        f"{t['name']} ({t['numel']:,}): median {t['median']:.3g} [{t['p5']:.3g}, {t['p95']:.3g}]" for t in tens))
    c = d["curvature"]
    if c is None:
        lines.append("curvature: not measured (model larger than --max-params, or --curvature no)")
    else:
        lines.append(f"curvature at the final model ({c['batches']} unseen batches, {c['probes']} probe(s) each):")
        lines.append(f"  H vs Hutchinson Hessian diagonal, all coordinates: {_fmt(c['overall']['hutchinson'])}")
        lines.append(f"  H vs gradient second moment, all coordinates: {_fmt(c['overall']['grad2'])}")
        lines.append(f"  per-tensor means of H vs Hutchinson across tensors: {_fmt(c['across_tensors']['hutchinson'])}; "
                     f"vs gradient second moment: {_fmt(c['across_tensors']['grad2'])}")
        for t in sorted(c["per_tensor"], key=lambda t: t["name"]):
            lines.append(f"  {t['name']}: H mean {t['h_mean']:.3g}, Hessian diag mean {t['hutchinson_mean']:.3g}, "
                         f"g^2 mean {t['grad2_mean']:.3g}; within: Hutchinson {_fmt(t['hutchinson'])}, g^2 {_fmt(t['grad2'])}")
    return "\n".join(lines)


PANEL_TENSORS = 30  # a full model has hundreds of tensors: their names would not be readable in one panel


def plot(d: dict[str, Any], path: str | Path) -> None:
    """``diagnose.png``: H's histogram, H and lr/H over rounds, per-tensor H, H vs curvature."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    h = d["_arrays"]["h"]
    ax = axes[0]
    lo, hi = np.log10(max(h.min(), 1e-30)), np.log10(max(h.max(), 1e-30))
    bins = np.logspace(lo, hi if hi > lo else lo + 1e-3, 60)
    ax.hist(h, bins=bins, color="#1f77b4")
    ax.set_xscale("log")
    ax.axvline(1.0, ls="--", c="k", lw=1)
    ax.set(title=f"H at round {d['rounds']}", xlabel="H", ylabel="coordinates")
    r = [x["round"] for x in d["over_rounds"]]
    for ax, key, title in ((axes[1], "h", "H over rounds"), (axes[2], "step", "effective step lr / H")):
        q = {k: [x[key][k] for x in d["over_rounds"]] for k in Q_NAMES}
        ax.fill_between(r, q["min"], q["max"], alpha=0.15, color="#1f77b4", label="min-max")
        ax.fill_between(r, q["p5"], q["p95"], alpha=0.35, color="#1f77b4", label="5-95 %")
        ax.plot(r, q["median"], c="#1f77b4", label="median")
        if key == "h" and "floor_level" in d["over_rounds"][0]:
            ax.plot(r, [x["floor_level"] for x in d["over_rounds"]], ls=":", c="#d62728", lw=1.5,
                    label="noise-floor level")
        if key == "step":
            ax.plot(r, [x.get("lr", d["lr"]) for x in d["over_rounds"]], ls="--", c="k", lw=1, label="lr (DeComFL)")
        ax.set_yscale("log")
        ax.set(title=title, xlabel="round")
        ax.legend(fontsize=7)
    ax = axes[3]
    every = d["per_tensor"]
    tens = every if len(every) <= PANEL_TENSORS else sorted(every, key=lambda t: -t["numel"])[:PANEL_TENSORS]
    y = np.arange(len(tens))
    ax.errorbar([t["median"] for t in tens], y,
                xerr=[[t["median"] - t["p5"] for t in tens], [t["p95"] - t["median"] for t in tens]], fmt="o", ms=3)
    ax.set_yticks(y, [t["name"] for t in tens], fontsize=6)
    ax.set_xscale("log")
    some = "" if len(tens) == len(every) else f", the {len(tens)} largest of {len(every)}"
    ax.set(title=f"H per tensor (median, 5-95 %{some})", xlabel="H")
    c = d["curvature"]
    for ax, key, title in ((axes[4], "hutchinson", "H vs Hessian diagonal (Hutchinson)"),
                           (axes[5], "grad2", "H vs gradient second moment")):
        if c is None:
            ax.text(0.5, 0.5, "curvature not measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        x = d["_arrays"][key]
        n = len(x)
        pick = np.random.default_rng(0).choice(n, size=min(n, 20000), replace=False)
        ax.scatter(x[pick], h[pick], s=2, alpha=0.3)
        ax.set_yscale("log")
        if np.all(x[pick] > 0):
            ax.set_xscale("log")
        ax.set(title=f"{title}\n{_fmt(c['overall'][key])}", xlabel=key, ylabel="H")
    fig.suptitle(f"hiso diagnose: {d['task']}, lr {d['lr']:g}, {d['rounds']} rounds")
    fig.savefig(path, dpi=110)


def write(d: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path, Path]:
    """Write ``diagnose.json``, ``diagnose.txt`` and ``diagnose.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "diagnose.json", out_dir / "diagnose.txt", out_dir / "diagnose.png"
    from ..atomic import write_atomic
    write_atomic(paths[0], json.dumps({k: v for k, v in d.items() if not k.startswith("_")}, indent=2))
    write_atomic(paths[1], summary_text(d) + "\n")
    plot(d, paths[2])
    return paths
