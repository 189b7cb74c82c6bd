"""The gradient norms behind a first-order run's rounds, replayed from its log.

    python bench/grad_spikes.py RUN --rounds 20,21,22 [--data-dir DIR]

For each named round r of a Ferret or sketch run, the model is rebuilt to x_r from the log, and
each client the record names answers again through the client's own code path
(:func:`hiso.core.client.answer_work`) while every backpropagation's gradient norm (over the
trainable tensors) is recorded. It prints, per client, the loss and gradient norm of each local
step, and checks that the answers' mean is the logged record (so the norms are the run's own,
not a re-run's). What it is for: telling a round whose step was large because one client's
gradient spiked from one whose clients all moved far.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from hiso.core.client import answer_work
from hiso.core.history import read_history
from hiso.core.messages import Downlink
from hiso.core.perturb import Perturber
from hiso.core.scalars import quantize
from hiso.runners.rebuild import rebuild
from hiso.runners.runfiles import saved_config
from hiso.tasks.registry import build_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--rounds", required=True, help="comma-separated rounds r (the record that moves x_r)")
    ap.add_argument("--data-dir", help="the task's data, if not where the run found it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, _ = saved_config(args.run)
    if args.data_dir:
        cfg = cfg.model_copy(update={"data_dir": args.data_dir})
    task = build_task(cfg)
    records = {r.round: r for r in read_history(f"{args.run}/history.bin")[2]}
    norms: list[float] = []
    grad = torch.autograd.grad

    def recording(outputs, inputs, *a, **kw):
        gs = grad(outputs, inputs, *a, **kw)
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in gs if g is not None]))))
        return gs

    torch.autograd.grad = recording
    for r in (int(x) for x in args.rounds.split(",")):
        rec = records[r]
        state, _ = rebuild(args.run, task=task, round=r)
        perturber = Perturber(state.model, state.params)
        ups = []
        for cid in rec.participants:
            norms.clear()
            msg = Downlink(r, rec.seeds, since=r, attempt=rec.attempt)
            up, work = answer_work(cid, state, perturber, task.loss,
                                   lambda rnd, k, c=cid: task.batch(c, rnd, k, cfg.batch_size), msg)
            ups.append(np.asarray(up.scalars, dtype=np.float64))
            print(json.dumps({"round": r, "client": cid, "loss": up.loss, "lr": state.cfg.lr_at(r),
                              "grad_norms": [round(n, 3) for n in norms],
                              "answer_norm": float(np.linalg.norm(ups[-1]))}))
        mean = quantize(np.mean(ups, axis=0).astype(np.float32), cfg.scalar_dtype)  # as the server logs it
        print(json.dumps({"round": r, "record_norm": float(np.linalg.norm(rec.scalars.astype(np.float64))),
                          "answers_mean_is_the_record": bool(np.array_equal(mean, rec.scalars))}))


if __name__ == "__main__":
    main()
