"""``ModelState.load_state_dict`` restores what ``state_dict`` saved: a replica saved after N
rounds, loaded into a fresh one built from x_0 and continued, is bit-identical to the replica
that never stopped (HiSo with momentum, DeComFL, a model with frozen tensors); a mismatched
state is refused with a clear error before anything is written."""

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from hiso.core import ModelState
from hiso.methods.hiso_method import decomfl, hiso
from hiso.methods.momentum import MomentumConfig
from hiso.core.history import RoundRecord

N = 4


def _model(frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    if frozen:  # only the last layer trains (as LoRA adapters over a frozen base)
        for p in m[0].parameters():
            p.requires_grad_(False)
    return m


def _records(cfg, n: int) -> list[RoundRecord]:
    rng = np.random.default_rng(1)
    tau, P = cfg.shape
    return [RoundRecord(r, rng.integers(1, 2**63, size=(tau, P), dtype=np.uint64),
                        rng.normal(size=(tau, P)).astype(np.float32), (0,)) for r in range(n)]


def _tensors(st: ModelState) -> list[torch.Tensor]:
    return [t for part in ("model", "h", "momentum") for t in st.state_dict().get(part, {}).values()]


CASES = {
    "hiso-momentum": (lambda: hiso(0.05, local_steps=2, perturbations=3, momentum=MomentumConfig(0.8)), False),
    "decomfl": (lambda: decomfl(0.05, perturbations=3), False),
    "hiso-frozen": (lambda: hiso(0.05, perturbations=2), True),
}


@pytest.mark.parametrize("case", CASES)
def test_save_load_continue_equals_uninterrupted(case):
    make_cfg, frozen = CASES[case]
    cfg = make_cfg()
    x0 = _model(frozen)
    recs = _records(cfg, 2 * N)
    whole = ModelState(copy.deepcopy(x0), cfg)
    whole.replay(recs)

    first = ModelState(copy.deepcopy(x0), cfg)
    first.replay(recs[:N])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # as model.pt holds it
    buf.seek(0)
    fresh = ModelState(copy.deepcopy(x0), cfg)
    params_before = [p for p in fresh.params]
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.round == N and all(a is b for a, b in zip(fresh.params, params_before))  # in place
    assert all(torch.equal(a, b) for a, b in zip(_tensors(fresh), _tensors(first)))
    fresh.replay(recs[N:])

    assert fresh.round == whole.round == 2 * N
    got, want = _tensors(fresh), _tensors(whole)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert (fresh.h is None) == (cfg.precond is None) and (fresh.m is None) == (cfg.momentum is None)
    # the continuation really moved: not a trivially equal pair
    assert not all(torch.equal(a, b) for a, b in zip(fresh.params, _model(frozen).parameters()))


def _saved(cfg, frozen=False) -> dict:
    st = ModelState(_model(frozen), cfg)
    st.replay(_records(cfg, 2))
    return copy.deepcopy(st.state_dict())


def test_mismatched_states_are_refused_and_change_nothing():
    cfg = hiso(0.05, perturbations=2)
    sd = _saved(cfg)
    st = ModelState(_model(False), cfg)
    before = [t.clone() for t in _tensors(st)]

    def refused(state, match):
        with pytest.raises(ValueError, match=match):
            st.load_state_dict(state)
        assert st.round == 0 and all(torch.equal(a, b) for a, b in zip(_tensors(st), before))

    refused({k: v for k, v in sd.items() if k != "h"}, "lacks 'h'")
    refused({**sd, "momentum": sd["h"]}, "has 'momentum'")
    bad = copy.deepcopy(sd)
    bad["model"]["2.weight"] = torch.zeros(3, 3)
    refused(bad, r"state\['model'\]\['2.weight'\] is \(\(3, 3\)")
    bad = copy.deepcopy(sd)
    bad["h"]["0.bias"] = bad["h"]["0.bias"].double()
    refused(bad, "float64")
    bad = copy.deepcopy(sd)
    bad["model"]["extra"] = bad["model"].pop("0.bias")
    refused(bad, r"missing \['0.bias'\], unexpected \['extra'\]")
    refused({**sd, "round": -1}, "round")
    # a HiSo state into a DeComFL replica, and the reverse
    with pytest.raises(ValueError, match="no preconditioner"):
        ModelState(_model(False), decomfl(0.05, perturbations=2)).load_state_dict(sd)
    with pytest.raises(ValueError, match="lacks 'h'"):
        st.load_state_dict(_saved(decomfl(0.05, perturbations=2)))
    # a full model's state into a replica with frozen tensors (it saves only the trainable ones)
    with pytest.raises(ValueError, match="unexpected"):
        ModelState(_model(True), cfg).load_state_dict(sd)


def test_a_checkpoint_with_its_base_entry_loads():
    cfg = decomfl(0.05, perturbations=2)
    sd = {**_saved(cfg, frozen=True), "base": {"model": "m", "fingerprint": "f"}}  # model.pt of a LoRA run
    st = ModelState(_model(True), cfg)
    st.load_state_dict(sd)
    assert st.round == 2 and all(torch.equal(a, b) for a, b in zip(st.params, sd["model"].values()))


@pytest.mark.parametrize("zo", [
    hiso(0.02, perturbations=3, local_steps=2, momentum=MomentumConfig(0.8)),
    decomfl(0.02, perturbations=3, momentum=MomentumConfig(0.8)),
], ids=["hiso-momentum", "decomfl-momentum"])
def test_faithful_resume_rebuilds_clients_with_their_momentum(zo):
    """Simulation.resume loads each faithful client from the server's replica (load_state_dict):
    the resumed run's server and clients equal the uninterrupted run's, bit for bit."""
    from conftest import TinyTask
    from hiso.runners.simulate import Simulation

    def sim():
        return Simulation(TinyTask(num_clients=6), zo, clients_per_round=2, seed=3, batch_size=8,
                          mode="faithful", eval_every=1000)
    whole = sim()
    records = [whole.step()[0] for _ in range(12)]
    cut = sim()
    cut.resume(records[:7])
    for _ in range(5):
        cut.step()
    assert cut.server.round == whole.server.round == 12
    assert all(torch.equal(a, b) for a, b in zip(_tensors(cut.state), _tensors(whole.state)))
    assert set(cut.clients) == set(whole.clients)
    for c in whole.clients:
        a, b = cut.clients[c].state, whole.clients[c].state
        assert a.round == b.round and all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b))), c


def _server_round(srv, r: int, sent: list | None = None) -> None:
    """Round r of a scripted run: some answers lost, every 5th round nobody answers (re-planned).
    ``sent`` collects the encoded downlinks of every plan."""
    from hiso.core import Uplink, encode_downlink
    rng = np.random.default_rng(r)
    while True:
        plan = srv.plan()
        if sent is not None:
            sent.append([encode_downlink(srv.downlink(c), srv.wire) for c in plan.participants])
        answer = [] if r % 5 == 4 and plan.attempt == 0 else plan.participants[: 1 + r % 3]
        ups = [Uplink(c, plan.round, rng.normal(size=srv.shape).astype(np.float32), 0.0, plan.attempt) for c in answer]
        rec = srv.aggregate(ups, partial=True)
        if rec is not None:
            if srv.replica is not None:
                srv.replica.apply(rec)
            return


def _server_view(srv):
    recs = [(r.round, r.seeds.tobytes(), r.scalars.tobytes(), r.participants, r.attempt) for r in srv.history]
    return recs, srv.first, srv.synced.tolist(), srv.attempt, srv.replanned


@pytest.mark.parametrize("snapshot_after", [None, 3])
def test_server_save_load_continue_equals_uninterrupted(snapshot_after):
    """Downlinks (history or snapshot), records, synced rounds and re-plans after a save/load
    are the uninterrupted server's, byte for byte."""
    from hiso.core import Server

    def server():
        replica = ModelState(_model(False), decomfl(0.05, local_steps=2, perturbations=2)) if snapshot_after else None
        return Server(6, 3, 2, 2, seed=5, replica=replica, snapshot_after=snapshot_after)
    whole, first = server(), server()
    for r in range(N):
        _server_round(whole, r)
        _server_round(first, r)
    saved = copy.deepcopy(first.state_dict())
    fresh = server()
    fresh.load_state_dict(saved)
    if snapshot_after:
        fresh.replica.load_state_dict(first.replica.state_dict())
    assert _server_view(fresh) == _server_view(first) and fresh.round == N
    sent_whole, sent_fresh = [], []
    for r in range(N, 4 * N):
        _server_round(whole, r, sent_whole)
        _server_round(fresh, r, sent_fresh)
    assert sent_fresh == sent_whole and _server_view(fresh) == _server_view(whole)
    assert whole.replanned > saved["replanned"]  # re-planned rounds happened after the load
    kinds = {d[1] for ds in sent_whole for d in ds}  # byte 1: the message kind (3 downlink, 4 snapshot)
    assert kinds == ({3, 4} if snapshot_after else {3}) and (whole.first > 0) == bool(snapshot_after)


def test_server_refuses_a_mismatched_state():
    from hiso.core import Server
    srv = Server(6, 3, 2, 2, seed=5)
    for r in range(3):
        _server_round(srv, r)
    sd = srv.state_dict()
    with pytest.raises(ValueError, match="another run seed"):
        Server(6, 3, 2, 2, seed=6).load_state_dict(sd)
    with pytest.raises(ValueError, match="7 clients"):
        Server(7, 3, 2, 2, seed=5).load_state_dict(sd)
    with pytest.raises(ValueError, match="shape"):
        Server(6, 3, 1, 2, seed=5).load_state_dict(sd)
    other = Server(6, 3, 2, 2, seed=5)
    with pytest.raises(ValueError, match="keys"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "sampler"})
    assert other.round == 0 and other.history == []
    other.plan()
    with pytest.raises(RuntimeError, match="planned"):
        other.state_dict()
