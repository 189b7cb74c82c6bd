"""Population scale: clients last sampled thousands of rounds ago rebuild x_R bit-exact."""

import numpy as np
import torch

from hiso.core import Client, ModelState, Uplink, decode_downlink, encode_downlink
from hiso.methods.hiso_method import hiso
from hiso.core.messages import encode_welcome, welcome_for
from hiso.core.server import Server
from hiso.core.snapshot import encode_state, load_state
from hiso.tasks.quadratic import QuadraticTask


def _same(a: ModelState, b: ModelState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.params + a.h, b.params + b.h, strict=True))


def test_clients_sampled_thousands_of_rounds_ago_rebuild_bit_exact():
    """5,000 clients, two a round, 3,000 rounds (seeded answers stand in for the losses): a
    client of an early round, holding the replica's bytes of then, catches up from its real
    downlink, ~2,900 records, onto x_R and H bit for bit; with the snapshot rule in play
    (snapshot_after=1,000) the same client gets the snapshot instead and lands there too."""
    task = QuadraticTask(5000, seed=0, dim=40)
    zo = hiso(lr=0.05, mu=1e-3, perturbations=2, local_steps=1)
    rng = np.random.default_rng(0)
    servers = {}
    for keep in (10**6, 1000):
        state = ModelState(task.build_model(), zo, run_seed=3)
        server = Server(5000, 2, 1, 2, seed=3, replica=state, snapshot_after=keep)
        held: dict[int, tuple[int, bytes]] = {}  # client -> (the round it answered, its model then)
        for r in range(3000):
            plan = server.plan()
            if r < 60:
                held.update({c: (r, encode_state(state)) for c in plan.participants})
            ups = [Uplink(c, r, rng.normal(0, 0.1, (1, 2)).astype(np.float32), None) for c in plan.participants]
            state.apply(server.aggregate(ups))
        servers[keep] = (server, state, held)
    (a, xa, held), (b, xb, _) = servers[10**6], servers[1000]
    assert not _same(xa, ModelState(task.build_model(), zo))  # x and H moved
    while True:  # the first round that samples a client of an early round, never sampled since
        plan = a.plan()
        late = [c for c in plan.participants if c in held and int(a.synced[c]) == held[c][0]]
        if late:
            break
        b.plan()  # the two servers sample alike (one seed), so they stay in step
        for s, x in ((a, xa), (b, xb)):
            x.apply(s.aggregate([Uplink(c, s.round, np.zeros((1, 2), np.float32), None) for c in plan.participants]))
    c, (r, payload) = late[0], held[late[0]]
    assert plan.round - r > 2900
    b.plan()
    welcome = encode_welcome(welcome_for(zo, 3, ModelState(task.build_model(), zo).params))  # x_0
    for server, x, replayed in ((a, xa, plan.round - r), (b, xb, 0)):
        client = Client(c, ModelState(task.build_model(), zo), task.loss, lambda rr, k: None)
        wire = client.join(welcome)
        load_state(client.state, payload, r)
        down = decode_downlink(encode_downlink(server.downlink(c), wire), wire)
        assert len(down.missed) == replayed and (down.snapshot is None) == (replayed > 0)
        client.catch_up(down)
        assert client.state.round == plan.round and _same(client.state, x)
