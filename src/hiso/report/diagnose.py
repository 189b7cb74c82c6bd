"""``hiso diagnose RUN``: what HiSo's preconditioner H learned in a finished run directory.

The run's log is replayed from x_0 exactly as ``hiso rebuild`` does (:func:`start_replica`,
then :meth:`ModelState.apply` round by round: the core's own update, so every H variant --
statistic, granularity, bias correction, clipping, momentum -- is the run's), and H is looked at
on the way at ``points`` rounds evenly spaced from 0 to the last: quantiles (min, 5 %, 50 %,
95 %, max) and mean, over all coordinates and per tensor. The last snapshot is the replica's
final H, which is checked against ``model.pt``.

Effective step. A round's directions are ``H^{-1/2} u`` (the clients' perturbation) and the
global update is ``ghat = H^{-1/2} (1/P) sum_p g_p u_p`` with ``g_p ~ u_p^T H^{-1/2} grad f``
(:mod:`hiso.core.state`, :mod:`hiso.core.perturb`), so ``E[ghat] = H^{-1} grad f`` for
``E[u u^T] = I``: H enters twice, and x moves by ``lr / H_i`` times the gradient's coordinate i
per local step, in expectation. That is the effective per-coordinate step reported here,
``lr / H`` (per local step; a round of tau local steps moves tau times that; with momentum in its
EMA form ``m = beta m + (1 - beta) ghat`` the gain is 1, so the steady-state step is the same).
DeComFL is H = 1: its step is lr everywhere, and there is nothing to diagnose.

Curvature (small models, or on request): at the final x, with torch autograd on ``batches``
minibatches the run never drew (``task.batch`` at rounds after the run's last, random
clients: batches of the training distribution, not of the rounds trained on), two per-
coordinate measures, averaged over the batches:

* the Hutchinson estimate of the Hessian's diagonal, ``E[v * (Hess v)]`` over Rademacher ``v``
  (``probes`` per batch, double backward). Exact for a diagonal Hessian (``v * v = 1``);
  otherwise coordinate i's estimate has variance ``sum_{j != i} Hess_ij^2`` per probe;
* the gradient's second moment ``E[g^2]`` (g the minibatch gradient).

They are compared with the final H by Spearman's rank correlation and Pearson's correlation,
over all coordinates, within each tensor, and across tensors (per-tensor means: does a
tensor-level H track curvature even where per-coordinate H is noise?).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)
QNAMES = ("min", "p05", "p50", "p95", "max")
SMALL_MODEL = 1_000_000  # trainable parameters up to which the curvature is computed by default


class DiagnoseError(ValueError):
    """A run directory that cannot be diagnosed (one line, for the command)."""


def quantiles(x: np.ndarray) -> dict[str, float]:
    """min, 5 %, 50 %, 95 %, max (numpy's linear interpolation) and mean of ``x`` in float64."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    q = np.quantile(x, QUANTILES)
    return {**{k: float(v) for k, v in zip(QNAMES, q)}, "mean": float(x.mean())}


def effective_step(h: np.ndarray, lr: float) -> np.ndarray:
    """The per-coordinate step ``lr / H`` (float64): E[x_{k+1} - x_k] = -lr H^{-1} grad f."""
    return lr / np.asarray(h, dtype=np.float64)


def snapshot_rounds(last: int, points: int) -> list[int]:
    """``points`` rounds evenly spaced over 0..last, both ends included (fewer if last is small)."""
    if points < 2:
        raise DiagnoseError(f"--points must be >= 2, got {points}")
    return sorted({int(round(v)) for v in np.linspace(0, last, points)})


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank (as Spearman's rho needs)."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    r = np.empty(len(x), dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends - 1) / 2.0
    r[order] = np.repeat(avg, ends - starts)
    return r


def pearson(a, b) -> float | None:
    """Pearson's r; None when either side is constant or there are fewer than 3 points."""
    a, b = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if a.size < 3:
        return None
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    return None if den == 0 else float(a @ b) / den


def spearman(a, b) -> float | None:
    """Spearman's rho (Pearson's r of the average ranks); None as :func:`pearson`."""
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    return pearson(_ranks(a), _ranks(b)) if a.size >= 3 else None


# --- curvature with autograd ---------------------------------------------------------------

def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    from ..core.state import trainable_params
    return [p for _, p in trainable_params(model)]


def hutchinson_diag(task, model: torch.nn.Module, batches, probes: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """E[v * (Hess v)] over Rademacher v (``probes`` per batch) and the batches: the Hessian
    diagonal of ``task.loss`` per trainable tensor (float64). A tensor the gradient does not
    depend on (the loss is linear in it) gets 0."""
    params = _params(model)
    acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for b in batches:
        loss = task.loss(model, b)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        for _ in range(probes):
            vs = [torch.randint(0, 2, params[i].shape, generator=gen).to(params[i].dtype).mul_(2).sub_(1)
                  for i in live]
            if live:
                hv = torch.autograd.grad([grads[i] for i in live], [params[i] for i in live], grad_outputs=vs,
                                         retain_graph=True, allow_unused=True)
                for i, v, h in zip(live, vs, hv):
                    if h is not None:
                        acc[i] += (v * h).detach().double().cpu()
            n += 1
    return [a / max(n, 1) for a in acc]


def grad_second_moment(task, model: torch.nn.Module, batches) -> list[torch.Tensor]:
    """E[g^2] of the minibatch gradient over the batches, per trainable tensor (float64)."""
    params = _params(model)
    acc = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    n = 0
    for b in batches:
        grads = torch.autograd.grad(task.loss(model, b), params, allow_unused=True)
        for a, g in zip(acc, grads):
            if g is not None:
                a += g.detach().double().cpu().square()
        n += 1
    return [a / max(n, 1) for a in acc]


def unseen_batches(task, cfg, rounds_done: int, n: int) -> list:
    """``n`` minibatches the run never drew: ``task.batch`` of random clients (seeded) at rounds
    after the run's last, local step 0, the run's batch size."""
    rng = np.random.default_rng([cfg.seed, 0xD1A6])
    clients = rng.integers(0, task.num_clients, size=n)
    return [task.batch(int(c), rounds_done + 1 + j, 0, cfg.batch_size) for j, c in enumerate(clients)]


# --- the diagnosis -------------------------------------------------------------------------

@dataclass
class Diagnosis:
    """What :func:`diagnose` found: ``summary`` (JSON-safe numbers) plus the arrays the figure
    draws (final H and curvature per tensor, float64 numpy)."""

    summary: dict
    names: list[str]
    h: list[np.ndarray]
    hutchinson: list[np.ndarray] | None = None
    grad2: list[np.ndarray] | None = None
    text: str = ""
    files: list[Path] = field(default_factory=list)


def _check_run_dir(run_dir: Path):
    from ..runners.rundir import saved_config

    if not run_dir.is_dir():
        raise DiagnoseError(f"{run_dir} is not a directory")
    try:
        cfg, info = saved_config(run_dir)
    except FileNotFoundError as e:
        raise DiagnoseError(str(e)) from None
    if not cfg.scalar_only:
        raise DiagnoseError(f"{run_dir} is a {cfg.algorithm} run: only HiSo runs learn a preconditioner H")
    if cfg.zo().precond is None:
        raise DiagnoseError(f"{run_dir} is a {cfg.algorithm} run: it has no preconditioner H (its step is "
                            f"lr = {cfg.lr:g} on every coordinate); nothing to diagnose")
    if not (run_dir / "history.bin").is_file():
        raise DiagnoseError(f"{run_dir}/history.bin not found: the run's rounds cannot be replayed")
    return cfg, info


def _corr(h: np.ndarray, c: np.ndarray) -> dict:
    return {"spearman": spearman(h, c), "pearson": pearson(h, c)}


def diagnose(run_dir: str | Path, points: int = 20, curvature: bool | None = None, batches: int = 8,
             probes: int = 4, task=None, progress: bool = False) -> Diagnosis:
    """Replay the run in ``run_dir``, take H at ``points`` rounds and (``curvature``: default
    when the model has at most :data:`SMALL_MODEL` trainable parameters) compare the final H
    with the measured curvature. Raises :class:`DiagnoseError` for a directory it cannot use."""
    from ..runners.rundir import start_replica
    from ..tasks.registry import build_task

    run_dir = Path(run_dir)
    cfg, _ = _check_run_dir(run_dir)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    task = task or build_task(cfg)
    state, records, _ = start_replica(run_dir, task)
    zo = cfg.zo()
    names = [n for n, _ in state.named]
    numel = [p.numel() for p in state.params]
    d = sum(numel)
    want = set(snapshot_rounds(len(records), points))
    snaps: list[dict] = []

    def snap() -> None:
        hs = [h.detach().cpu().numpy().reshape(-1) for h in state.h]
        allh = np.concatenate(hs)
        snaps.append({"round": state.round, "h": quantiles(allh), "step": quantiles(effective_step(allh, zo.lr)),
                      "tensors": {n: quantiles(h) for n, h in zip(names, hs)}})

    if 0 in want:
        snap()
    it = records
    if progress and len(records) > 50:
        from tqdm import tqdm
        it = tqdm(records, desc="replaying", unit="round", dynamic_ncols=True, leave=False)
    for rec in it:
        state.apply(rec)
        if state.round in want:
            snap()
    h_final = [h.detach().cpu().double().numpy().reshape(-1).copy() for h in state.h]

    matches = None
    if (run_dir / "model.pt").is_file():
        saved = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True).get("h") or {}
        matches = bool(saved) and all(n in saved and torch.equal(saved[n].cpu(), h.cpu())
                                      for n, h in zip(names, state.h))
    pc = zo.precond
    summary = {
        "run_dir": str(run_dir), "algorithm": cfg.algorithm, "task": cfg.task, "lr": zo.lr,
        "local_steps": zo.local_steps, "perturbations": zo.perturbations, "rounds": len(records), "d": d,
        "momentum": cfg.momentum,
        "preconditioner": {"nu": pc.nu, "eps": pc.eps, "h_min": pc.h_min, "h_max": pc.h_max, "source": pc.source,
                           "stat": pc.stat, "granularity": pc.granularity, "bias_correction": pc.bias_correction},
        "effective_step": "lr / H per coordinate and local step (E[ghat] = H^-1 grad f)",
        "replay_matches_model_pt": matches,
        "tensors": [{"name": n, "numel": k} for n, k in zip(names, numel)],
        "points": snaps,
        "final": snaps[-1],
        "curvature": None,
    }
    out = Diagnosis(summary, names, h_final)
    if curvature is None:
        curvature = d <= SMALL_MODEL
    if curvature:
        model = state.model
        bs = unseen_batches(task, cfg, len(records), batches)
        hut = [t.numpy().reshape(-1) for t in hutchinson_diag(task, model, bs, probes, seed=cfg.seed)]
        g2 = [t.numpy().reshape(-1) for t in grad_second_moment(task, model, bs)]
        out.hutchinson, out.grad2 = hut, g2
        allh, allc, allg = (np.concatenate(v) for v in (h_final, hut, g2))
        per = []
        for n, h, c, g in zip(names, h_final, hut, g2):
            per.append({"name": n, "h_mean": float(h.mean()), "hutchinson_mean": float(c.mean()),
                        "grad2_mean": float(g.mean()), "hutchinson": _corr(h, c), "grad2": _corr(h, g)})
        across = {"hutchinson": _corr([p["h_mean"] for p in per], [p["hutchinson_mean"] for p in per]),
                  "grad2": _corr([p["h_mean"] for p in per], [p["grad2_mean"] for p in per])}
        summary["curvature"] = {
            "batches": batches, "batch_size": cfg.batch_size, "probes": probes,
            "overall": {"hutchinson": _corr(allh, allc), "grad2": _corr(allh, allg)},
            "across_tensors": across, "tensors": per,
            "hutchinson_negative_share": float((allc < 0).mean()),
        }
    out.text = summary_text(summary)
    return out


# --- text and figure -----------------------------------------------------------------------

def _g(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _c(v) -> str:
    return "  n/a" if v is None else f"{v:+.2f}"


def summary_text(s: dict) -> str:
    """The short text report of a :func:`diagnose` summary."""
    pc = s["preconditioner"]
    lines = [f"hiso diagnose {s['run_dir']}: {s['algorithm']} on {s['task']}, {s['rounds']} rounds replayed, "
             f"d = {s['d']:,} in {len(s['tensors'])} tensors",
             f"H: granularity {pc['granularity']}, stat {pc['stat']}, nu {pc['nu']:g}, eps {pc['eps']:g}, "
             f"source {pc['source']}, bias correction {'on' if pc['bias_correction'] else 'off'}"
             + (f", clip [{_g(pc['h_min'])}, {_g(pc['h_max'])}]" if pc["h_min"] or pc["h_max"] else "")
             + (f", momentum {s['momentum']:g}" if s["momentum"] else "")]
    if s["replay_matches_model_pt"] is False:
        lines.append("WARNING: the replayed H differs from model.pt's (or model.pt holds no H)")
    f = s["final"]
    h = f["h"]
    lines.append(f"H at round {f['round']} (H_0 = 1): min {h['min']:.3g}, 5% {h['p05']:.3g}, median {h['p50']:.3g}, "
                 f"95% {h['p95']:.3g}, max {h['max']:.3g} (95%/5% = {h['p95'] / h['p05']:.3g})")
    st = f["step"]
    lines.append(f"effective step lr/H per coordinate and local step (lr = {s['lr']:g}): 5% {st['p05']:.3g}, "
                 f"median {st['p50']:.3g}, 95% {st['p95']:.3g} (median = {st['p50'] / s['lr']:.3g} x lr)")
    pts = s["points"]
    show = pts if len(pts) <= 6 else [pts[i] for i in np.unique(np.linspace(0, len(pts) - 1, 6).round().astype(int))]
    lines.append("H over rounds (median [5%, 95%]): " + ", ".join(
        f"r{p['round']} {p['h']['p50']:.3g} [{p['h']['p05']:.3g}, {p['h']['p95']:.3g}]" for p in show))
    cur = s["curvature"]
    per = {p["name"]: p for p in cur["tensors"]} if cur else {}
    w = max(6, *(len(t["name"]) for t in s["tensors"]))
    head = f"  {'tensor':<{w}} {'numel':>9} {'mean H':>9} {'median':>9} {'5%':>9} {'95%':>9}"
    if cur:
        head += f" {'hutch mean':>10} {'E[g^2] mean':>11} {'rho(H,hutch)':>12} {'rho(H,g^2)':>10}"
    lines += [f"per tensor at round {f['round']}:", head]
    for t in s["tensors"]:
        q = f["tensors"][t["name"]]
        row = f"  {t['name']:<{w}} {t['numel']:>9,} {q['mean']:>9.3g} {q['p50']:>9.3g} {q['p05']:>9.3g} {q['p95']:>9.3g}"
        if cur:
            p = per[t["name"]]
            row += (f" {p['hutchinson_mean']:>10.3g} {p['grad2_mean']:>11.3g} {_c(p['hutchinson']['spearman']):>12}"
                    f" {_c(p['grad2']['spearman']):>10}")
        lines.append(row)
    if cur:
        o, a = cur["overall"], cur["across_tensors"]
        lines += [f"curvature at the final x ({cur['batches']} unseen batches of {cur['batch_size']}, "
                  f"{cur['probes']} Rademacher probes each; rho Spearman, r Pearson; "
                  f"{100 * cur['hutchinson_negative_share']:.0f}% of Hutchinson estimates < 0):",
                  f"  all coordinates: H vs Hutchinson diag rho {_c(o['hutchinson']['spearman'])} r "
                  f"{_c(o['hutchinson']['pearson'])}; H vs E[g^2] rho {_c(o['grad2']['spearman'])} r "
                  f"{_c(o['grad2']['pearson'])}"]
        if len(s["tensors"]) >= 3:
            lines += [f"  across tensors (per-tensor means, n = {len(s['tensors'])}): H vs Hutchinson rho "
                  f"{_c(a['hutchinson']['spearman'])} r {_c(a['hutchinson']['pearson'])}; H vs E[g^2] rho "
                      f"{_c(a['grad2']['spearman'])} r {_c(a['grad2']['pearson'])}"]
        if pc["granularity"] != "coordinate":
            lines.append(f"  (H is constant within each {'tensor' if pc['granularity'] == 'tensor' else 'model'}: "
                         "within-tensor correlations are undefined)")
    else:
        lines.append("curvature: not computed (a large model; --curvature to force it)")
    return "\n".join(lines) + "\n"


def plot(diag: Diagnosis, path: str | Path, max_points: int = 20000) -> Path:
    """``diagnose.png``: final H histogram, H and lr/H quantiles over rounds, per-tensor H, and
    H against the curvature (when computed)."""
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg", force=False)
    s = diag.summary
    allh = np.concatenate(diag.h)
    cur = diag.hutchinson is not None
    fig = Figure(figsize=(15, 8.5 if cur else 4.6), dpi=100, layout="constrained")
    axes = fig.subplots(2 if cur else 1, 4 if not cur else 3, squeeze=False).reshape(-1)
    ax = axes[0]
    pos = allh[allh > 0]
    lo, hi = math.log10(min(pos.min(), 1.0)), math.log10(max(pos.max(), 1.0))
    if hi - lo < 1e-6:
        lo, hi = lo - 0.5, hi + 0.5
    ax.hist(pos, bins=np.logspace(lo, hi, 61), weights=np.full(pos.size, 100.0 / pos.size), color="#1f77b4")
    ax.axvline(1.0, color="0.35", ls="--", lw=1, label="$H_0 = 1$")
    ax.set_xscale("log")
    ax.set_xlabel("H")
    ax.set_ylabel("share of coordinates (%)")
    ax.set_title(f"H at round {s['final']['round']} ({s['d']:,} coordinates)", fontsize=10)
    ax.legend(fontsize=8)
    rounds = [p["round"] for p in s["points"]]
    for ax, key, label in ((axes[1], "h", "H"), (axes[2], "step", "effective step lr/H")):
        q = {k: np.array([p[key][k] for p in s["points"]]) for k in QNAMES}
        ax.fill_between(rounds, q["min"], q["max"], color="#1f77b4", alpha=0.12, label="min-max")
        ax.fill_between(rounds, q["p05"], q["p95"], color="#1f77b4", alpha=0.3, label="5%-95%")
        ax.plot(rounds, q["p50"], color="#1f77b4", lw=1.8, label="median")
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_title(f"{label} over rounds", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(s["lr"], color="0.35", ls="--", lw=1)
    ax = axes[3]
    f = s["final"]["tensors"]
    y = np.arange(len(diag.names))
    med = np.array([f[n]["p50"] for n in diag.names])
    ax.errorbar(med, y, fmt="o", color="#1f77b4", ecolor="0.3", capsize=3, label="median H, 5%-95%",
                xerr=[med - [f[n]["p05"] for n in diag.names], [f[n]["p95"] for n in diag.names] - med])
    ax.plot([f[n]["mean"] for n in diag.names], y, "x", color="#d62728", label="mean H")
    ax.legend(fontsize=8)
    ax.set_yticks(y, diag.names, fontsize=7)
    ax.invert_yaxis()
    if max(f[n]["p95"] for n in diag.names) > 10 * min(f[n]["p05"] for n in diag.names):
        ax.set_xscale("log")
    ax.set_xlabel("H")
    ax.axvline(1.0, color="0.35", ls="--", lw=1)
    ax.set_title("H per tensor", fontsize=10)
    ax.grid(True, alpha=0.3)
    if cur:
        rng = np.random.default_rng(0)
        pick = rng.choice(allh.size, min(max_points, allh.size), replace=False)
        for ax, vals, label in ((axes[4], diag.hutchinson, "Hutchinson diag of the Hessian"),
                                (axes[5], diag.grad2, "E[g^2] (gradient second moment)")):
            v = np.concatenate(vals)
            tens = np.repeat(np.arange(len(diag.names)), [len(h) for h in diag.h])
            sc = ax.scatter(allh[pick], v[pick], c=tens[pick], s=3, cmap="tab10", alpha=0.5,
                            vmin=0, vmax=max(len(diag.names) - 1, 1))
            ax.set_xscale("log")
            if (v > 0).all():
                ax.set_yscale("log")
            elif (v >= 0).all():  # exact zeros (a dead unit's gradient)
                ax.set_yscale("symlog", linthresh=float(np.quantile(v[v > 0], 0.05)) if (v > 0).any() else 1e-12)
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("symlog", linthresh=max(float(np.quantile(np.abs(v[v != 0]), 0.05)) if (v != 0).any()
                                                      else 1e-12, 1e-12))
            key = "hutchinson" if vals is diag.hutchinson else "grad2"
            o = s["curvature"]["overall"][key]
            ax.set_xlabel("H (final)")
            ax.set_ylabel(label)
            ax.set_title(f"H vs {label.split(' (')[0]}: rho {_c(o['spearman'])}", fontsize=10)
            ax.grid(True, alpha=0.3)
        if len(diag.names) > 1:
            cb = fig.colorbar(sc, ax=axes[5], label="tensor (index in the per-tensor panel)")
            cb.set_ticks(range(len(diag.names)) if len(diag.names) <= 12 else cb.get_ticks())
    fig.suptitle(f"{s['algorithm']} on {s['task']}: what H learned ({s['run_dir']})", fontsize=11)
    path = Path(path)
    fig.savefig(path)
    return path


def write(diag: Diagnosis, out: str | Path) -> list[Path]:
    """``diagnose.txt``, ``diagnose.json`` and ``diagnose.png`` in ``out`` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.txt").write_text(diag.text)
    (out / "diagnose.json").write_text(json.dumps(diag.summary, indent=2))
    diag.files = [out / "diagnose.txt", out / "diagnose.json", plot(diag, out / "diagnose.png")]
    return diag.files
