"""The ServerApp's side of a node's join: its answer to the ``query`` names the partitions it
serves (one, or several: :mod:`hiso.flower.parts`) and the round each one's replica holds;
each is mapped to the node, its join counted in the bytes, and its round told to the server."""

from __future__ import annotations

from ..core.messages import Hello, MessageError, decode_hello, encode_hello
from .parts import split_answer
from .records import log, reply_bytes, reply_int

def take_join(fed, nid: int, rec) -> None:
    """Node ``nid``'s answer ``rec`` to its query: every valid partition in it joins ``fed`` (the
    ServerApp's :class:`~hiso.flower.server_app.FlowerFederation`, which imports this module)."""
    try:
        answers = split_answer(rec)
    except (KeyError, TypeError, ValueError) as e:
        log.warning("node %s: no valid join answer (%s): ignored", nid, e)
        return
    for one in answers:
        _take_one(fed, nid, one)


def _take_one(fed, nid: int, rec) -> None:
    welcome = getattr(fed, "welcome", None)
    try:  # the node's join: its hello (it checked our welcome before answering)
        if welcome is not None:
            hello = decode_hello(reply_bytes(rec, "hello"))
            pid, held = hello.client, hello.round
        else:  # full-model baselines: no join, the node names its partition
            pid, held = reply_int(rec, "partition"), reply_int(rec, "round")
    except (KeyError, ValueError, MessageError) as e:
        log.warning("node %s: no valid hello (%s): ignored", nid, e)
        return
    if not 0 <= pid < fed.task.num_clients:
        log.warning("node %s names partition %s, outside 0..%s: ignored", nid, pid, fed.task.num_clients - 1)
        return
    old = fed.node_of.get(pid)
    if old is not None and old != nid:
        log.warning("partition %s moves from node %s to node %s", pid, old, nid)
        left = fed.parts_of.get(old, set())
        left.discard(pid)
        if not left:
            fed.parts_of.pop(old, None)
            fed.part_of.pop(old, None)
        elif fed.part_of.get(old) == pid:
            fed.part_of[old] = min(left)
    fed.node_of[pid], fed.part_of[nid] = nid, pid
    fed.parts_of.setdefault(nid, set()).add(pid)
    if welcome is not None:
        if pid in fed._counted:  # counted when placed: only a hello of another size differs
            fed._counted.discard(pid)
            fed.comm.up[pid] += len(rec["hello"]) - len(encode_hello(Hello(pid, 0)))
        else:
            fed.comm.join(pid, rec["hello"], welcome)
    fed.server.client_holds(pid, min(held, fed.server.round))
