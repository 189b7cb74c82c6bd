"""How well each frontier arm's round update points along the true gradient, on the same batches.

    python bench/alignment.py --data-dir PATH/TO/mnist [--run DIR --round R] [--rounds 20]

At a model (x_0, or round R of a run rebuilt from its log), for each of ``--rounds`` rounds the
federation of configs/frontier_mnist_full.toml samples 8 of 64 Dirichlet(1) clients and each
draws its batch of 32, as a run does. Every arm turns those batches into the server's update
direction by its own rule, and the bench reports the cosine of that direction with the **full
training-set gradient** (60,000 images), and with the mean of the 8 clients' minibatch gradients
(FedSGD: what any method that sees one batch per client could at best point along):

- decomfl: forward differences, P = 5 Rademacher directions, mu = 1e-3 (ZO);
- zo16: the same with P = 16 (int8's bytes are not simulated: quantisation moves it little);
- sketch1: the exact minibatch gradient projected on K = 128 directions, each sent as its sign,
  decoded as sign x the client's mean |projection| (signSGD's scaled sign), averaged by the server;
- sketch4: K = 32 projections on a symmetric 4-bit grid with one scale (max / 7);
- ferret: K = 200 projections on each of 8 blocks, float32;
- fedsgd: the minibatch gradients themselves (full-model communication).

A round's directions come from its seed and are the same for every client of the round (the
log holds one averaged coefficient per direction); its update is sum_k c_k u_k over the server's
averaged coefficients. The cosine is what one round's step
can gain per unit of step length; for an unbiased random-subspace estimate of a vector g its
expectation is about sqrt(K / d) x cos(g, G), so the bench also prints that prediction.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
from torch.func import functional_call

from hiso.config import RunConfig
from hiso.core.server import client_sampler, sample_clients
from hiso.tasks.registry import build_task


def flat_grad(model, names, loss) -> torch.Tensor:
    grads = torch.autograd.grad(loss, [p for _, p in names])
    return torch.cat([g.reshape(-1) for g in grads])


def loss_at(model, names, shapes, task, batch, x: torch.Tensor) -> float:
    params, i = {}, 0
    for (n, _), s in zip(names, shapes):
        k = math.prod(s)
        params[n] = x[i:i + k].view(s)
        i += k
    with torch.no_grad():
        x_, y_ = batch
        out = functional_call(model, params, (x_,))
        return float(torch.nn.functional.cross_entropy(out, y_, reduction="mean").double())


def rademacher(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n, d), generator=g).float().mul_(2).sub_(1)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm() + 1e-300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--run", help="a run directory to take the model from (default: x_0)")
    ap.add_argument("--round", type=int, help="with --run: the model after this many rounds")
    ap.add_argument("--rounds", type=int, default=20, help="rounds sampled (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = RunConfig(task="mnist", data_dir=args.data_dir, clients=64, partition="dirichlet", alpha=1.0,
                    sampled=8, batch_size=32, seed=args.seed)
    task = build_task(cfg)
    if args.run:
        from hiso.runners.rebuild import rebuild
        state, _ = rebuild(args.run, round=args.round)
        model = state.model
    else:
        model = task.build_model()
    model.eval()
    names = [(n, p) for n, p in model.named_parameters()]
    shapes = [p.shape for _, p in names]
    x0 = torch.cat([p.detach().reshape(-1) for _, p in names])
    d = x0.numel()
    sizes = [math.prod(s) for s in shapes]

    # the full training-set gradient, in chunks of 2,000 images
    data = task.data
    G = torch.zeros(d, dtype=torch.float64)
    n = len(data.y_train)
    for i in range(0, n, 2000):
        xb, yb = data.normalise(data.x_train[i:i + 2000]), data.y_train[i:i + 2000]
        loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") / n
        G += flat_grad(model, names, loss).double()
    G = G.float()

    gen = torch.Generator().manual_seed(1234 + args.seed)
    rng = client_sampler(args.seed)
    arms = ("decomfl", "zo16", "sketch1", "sketch4", "ferret", "fedsgd")
    res: dict[str, list[float]] = {a: [] for a in arms}
    res_mb: dict[str, list[float]] = {a: [] for a in arms}
    block_of = np.repeat(np.arange(8), -(-d // 8))[:d]  # ferret's 8 blocks, contiguous
    for r in range(args.rounds):
        clients = list(sample_clients(rng, cfg.clients, cfg.sampled))
        batches = [task.batch(c, r, 0, cfg.batch_size) for c in clients]
        grads = [flat_grad(model, names, task.loss(model, b)) for b in batches]
        g_mean = torch.stack(grads).mean(0)
        # each arm's directions are the round's (drawn once from its seed, shared by its clients);
        # the server averages the clients' coefficients, as the log records them
        U5, U16, U128, U32 = (rademacher(k_, d, gen) for k_ in (5, 16, 128, 32))
        Uf = [rademacher(200, int((block_of == blk).sum()), gen) for blk in range(8)]
        blocks = [torch.from_numpy(np.nonzero(block_of == blk)[0]) for blk in range(8)]
        coef = {a: [] for a in arms if a != "fedsgd"}
        for b, g in zip(batches, grads):
            f0 = loss_at(model, names, shapes, task, b, x0)
            for arm, U in (("decomfl", U5), ("zo16", U16)):
                coef[arm].append(torch.tensor([(loss_at(model, names, shapes, task, b, x0 + 1e-3 * u) - f0) / 1e-3
                                               for u in U]))
            proj = U128 @ g
            coef["sketch1"].append(proj.sign() * proj.abs().mean())
            proj = U32 @ g
            scale = proj.abs().max() / 7
            coef["sketch4"].append(torch.round(proj / scale).clamp(-7, 7) * scale)
            coef["ferret"].append(torch.cat([U @ g[idx] for U, idx in zip(Uf, blocks)]))
        dirs = {"fedsgd": g_mean}
        for arm, U in (("decomfl", U5), ("zo16", U16), ("sketch1", U128), ("sketch4", U32)):
            dirs[arm] = torch.stack(coef[arm]).mean(0) @ U / len(U)
        c = torch.stack(coef["ferret"]).mean(0)
        dirs["ferret"] = torch.zeros(d)
        for j, (U, idx) in enumerate(zip(Uf, blocks)):
            dirs["ferret"][idx] = c[200 * j:200 * (j + 1)] @ U / 200
        for a in arms:
            res[a].append(cos(dirs[a], G))
            res_mb[a].append(cos(dirs[a], g_mean))
    k = {"decomfl": 5, "zo16": 16, "sketch1": 128 * 2 / math.pi, "sketch4": 32, "ferret": 1600, "fedsgd": d}
    fed = float(np.mean(res["fedsgd"]))
    print(f"d = {d:,}; model: {args.run or 'x_0'}{f' round {args.round}' if args.round is not None else ''}; "
          f"{args.rounds} rounds of 8 clients x 32 images; cosine with the full gradient (mean +- std), "
          f"with the clients' mean minibatch gradient, and sqrt(K/d) x cos(fedsgd, G)")
    print("| arm | cos(update, full gradient) | cos(update, minibatch mean) | predicted |")
    print("|---|---:|---:|---:|")
    for a in arms:
        pred = min(1.0, math.sqrt(k[a] / d)) * fed if a != "fedsgd" else fed
        print(f"| {a} | {np.mean(res[a]):.4f} +- {np.std(res[a]):.4f} | {np.mean(res_mb[a]):.4f} | {pred:.4f} |")
        print(json.dumps({"arm": a, "cos_full": float(np.mean(res[a])), "cos_full_std": float(np.std(res[a])),
                          "cos_minibatch": float(np.mean(res_mb[a])), "predicted": pred, "d": d,
                          "round": args.round, "run": args.run}))


if __name__ == "__main__":
    main()
