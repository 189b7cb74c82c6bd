"""Which partitions a SuperNode serves, and a join answer for several of them.

A node serves one partition (node config ``partition-id=3``, as before) or several
(``partition-id='1,3'``: many simulated clients on a few machines). The server's ``query``
(the join) reaches the node once: a node of several partitions answers with one list per
field (``partitions``, ``rounds`` and, for the scalar-only algorithms, ``hellos``) instead of
the single ``partition``/``round``/``hello``; every ``train`` message to it names the
partition it is for (``partition``). Standard library only: the relay ClientApp
(:mod:`hiso.flower.relay`) imports it."""

from __future__ import annotations

# the fields of one partition's join answer, and the list field each goes into for several
_LISTED = {"partition": "partitions", "round": "rounds", "hello": "hellos"}


def node_partitions(node_config) -> list[int]:
    """The partitions of a node's config: ``partition-id`` as an integer, or a string of
    comma-separated integers. ValueError when it has none or they do not parse."""
    if "partition-id" not in node_config:
        raise ValueError("this SuperNode has no partition: start it with --node-config 'partition-id=N' "
                         "(or partition-id='N,M,...' for several)")
    v = node_config["partition-id"]
    try:
        pids = [int(v)] if isinstance(v, int) else [int(x) for x in str(v).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"partition-id={v!r}: expected an integer or comma-separated integers") from None
    if not pids or len(set(pids)) != len(pids) or min(pids) < 0:
        raise ValueError(f"partition-id={v!r}: expected distinct non-negative integers")
    return pids


def message_partition(node_config, fields) -> int:
    """The partition a message is for: the one it names (``partition``, which must be one of the
    node's), else the node's only one (a node of several refuses a message that names none)."""
    pids = node_partitions(node_config)
    if "partition" in fields:
        pid = fields["partition"]
        if type(pid) is not int or pid not in pids:
            raise ValueError(f"message for partition {pid!r}: this node serves {pids}")
        return pid
    if len(pids) > 1:
        raise ValueError(f"this node serves partitions {pids}: a message must name its partition")
    return pids[0]


def joint_answer(answers: list[dict]) -> dict:
    """The join answer of a node from its partitions' ones (a single answer is kept as it is)."""
    if len(answers) == 1:
        return answers[0]
    keys = set(answers[0])
    if any(set(a) != keys for a in answers) or not keys <= set(_LISTED):
        raise ValueError(f"join answers of other fields: {[sorted(a) for a in answers]}")
    return {_LISTED[k]: [a[k] for a in answers] for k in sorted(keys)}


def split_answer(rec) -> list[dict]:
    """A node's join answer as one answer per partition (the inverse of :func:`joint_answer`);
    lists of unequal lengths give ValueError."""
    if "partitions" not in rec:
        return [rec]
    cols = {k: list(rec[many]) for k, many in _LISTED.items() if many in rec}
    n = len(cols["partition"])
    if any(len(v) != n for v in cols.values()):
        raise ValueError("join answer: lists of unequal lengths")
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def spread(partitions: int, nodes: int) -> list[list[int]]:
    """Partitions ``0..partitions-1`` dealt to ``nodes`` nodes in turn: node i serves i, i+nodes, ..."""
    return [list(range(i, partitions, nodes)) for i in range(nodes)]


def node_config_value(pids: list[int]) -> str:
    """``partition-id``'s value for a node config string (a bare integer for a single partition)."""
    return str(pids[0]) if len(pids) == 1 else "'" + ",".join(map(str, pids)) + "'"
