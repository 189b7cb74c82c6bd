"""What can go wrong between a client and the server, simulated: lost, late, repeated and
damaged answers, and Byzantine clients.

Every draw comes from its own seeded stream, keyed by (run seed, salt, plan number, client),
so a run without faults draws nothing and is unchanged bit for bit, and the faults of one
round do not depend on how many were drawn before it. The plan number is a function of the
logged rounds (round r's plans come after those of rounds 0..r-1, each ``attempt + 1`` of
them), so a resumed run draws every fault and attacker again as the interrupted one did
(:meth:`hiso.runners.simulate.Simulation.resume`).

Faults (each answer gets at most one; the rates are probabilities per answer, summing to < 1):

* ``drop``: the answer is lost. The client got its downlink, caught up and computed (in
  faithful mode); the server never hears from it. Its next downlink starts at the round the
  server last saw it in, and the client skips what it already holds.
* ``late``: the answer arrives after its round closed, in the next round's batch of answers,
  where it is rejected as being for the wrong round.
* ``duplicate``: the answer is sent twice; the server keeps the first and rejects the second.
* ``corrupt``: 1 to 3 distinct bits of the sent bytes are flipped. The simulator's uplinks
  then travel in a CRC-32 frame (:func:`seal`), checked before decoding: CRC-32 detects every
  error of up to 3 bits in messages under 91,607 bits (its Hamming distance is 4 there), so
  a flip that would decode to plausible but wrong scalars (a mantissa bit, a client id) is
  rejected with certainty, not only the ones the decoder notices (magic, version, lengths,
  non-finite values). Faults on or off, the protocol's own messages are the same bytes; the
  frame adds 4 bytes per uplink, counted, only in runs with faults.

Byzantine clients (``--byzantine K``) are K clients drawn once from their own seeded stream
(so a round holds as many of them as its sample happens to: sometimes a majority); or, with
``per_round``, K of each round's sampled clients, drawn per round (exactly K attackers in
every round). Each computes its honest answer and then lies about it (attacks are given to
the attackers in turn, from a comma list):

* ``scale``: scalars times ``attack_scale`` (default 1e3);
* ``sign-flip``: scalars negated;
* ``random``: normal noise with ``attack_scale`` times the RMS of its honest scalars;
* ``nan``: NaN scalars (the decoder rejects them).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..config_parse import ATTACKS, parse_attacks  # noqa: F401 (the spec is the configuration's)
from ..core.messages import MessageError

FATES = ("ok", "drop", "late", "duplicate", "corrupt")
_SALT_FAULT, _SALT_DAMAGE, _SALT_BYZ, _SALT_ATTACK = 0xFA17, 0xDA3A, 0xB12A, 0xA77C


class ChecksumError(MessageError):
    """A framed message whose CRC-32 does not match its bytes (damaged in transit)."""

    code = "checksum"


def seal(data: bytes) -> bytes:
    """``data`` followed by its CRC-32 (little-endian u32)."""
    return data + zlib.crc32(data).to_bytes(4, "little")


def unseal(data: bytes) -> bytes:
    """The payload of a :func:`seal`-ed message; :class:`ChecksumError` if it was damaged."""
    if len(data) < 4 or zlib.crc32(data[:-4]).to_bytes(4, "little") != bytes(data[-4:]):
        raise ChecksumError(f"checksum mismatch in a {len(data)}-byte message (damaged in transit)")
    return bytes(data[:-4])


@dataclass(frozen=True)
class Faults:
    """Per-answer fault probabilities and the run seed their stream derives from."""

    drop: float = 0.0
    late: float = 0.0
    duplicate: float = 0.0
    corrupt: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        rates = (self.drop, self.late, self.duplicate, self.corrupt)
        if any(not 0 <= r <= 1 for r in rates):
            raise ValueError(f"fault rates must be in [0, 1], got {rates}")
        if sum(rates) >= 1:
            raise ValueError(f"fault rates sum to {sum(rates):g}: they must leave some answers intact (< 1)")

    @property
    def active(self) -> bool:
        return any((self.drop, self.late, self.duplicate, self.corrupt))

    def fate(self, plan: int, client: int) -> str:
        """What happens to ``client``'s answer in the ``plan``-th planned round (0-based)."""
        if not self.active:
            return "ok"
        u = np.random.default_rng([self.seed, _SALT_FAULT, plan, client]).random()
        edges = np.cumsum([self.drop, self.late, self.duplicate, self.corrupt])
        i = int(np.searchsorted(edges, u, side="right"))
        return FATES[i + 1] if i < 4 else "ok"

    def damage(self, data: bytes, plan: int, client: int) -> bytes:
        """``data`` with 1 to 3 distinct bits flipped (seeded by plan and client)."""
        rng = np.random.default_rng([self.seed, _SALT_DAMAGE, plan, client])
        k = int(rng.integers(1, 4))
        out = bytearray(data)
        for bit in rng.choice(8 * len(out), size=min(k, 8 * len(out)), replace=False):
            out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)


class Attackers:
    """K Byzantine clients of M, drawn from their own seeded stream, each with its attack."""

    def __init__(self, num_clients: int, k: int, attacks: str = "scale", scale: float = 1e3, seed: int = 0,
                 per_round: bool = False):
        if not 0 <= k <= num_clients:
            raise ValueError(f"byzantine must be in [0, {num_clients}], got {k}")
        self.names = parse_attacks(attacks)
        self.seed, self.scale, self.k, self.per_round = seed, float(scale), k, per_round
        rng = np.random.default_rng([seed, _SALT_BYZ])
        chosen = [] if per_round else np.sort(rng.choice(num_clients, k, replace=False))
        self.attack = {int(c): self.names[i % len(self.names)] for i, c in enumerate(chosen)}  # client -> attack

    @property
    def active(self) -> bool:
        return self.k > 0

    def of_round(self, plan: int, participants: tuple[int, ...]) -> dict[int, str]:
        """The attackers among a round's ``participants`` (client -> attack)."""
        if not self.per_round:
            return {c: self.attack[c] for c in participants if c in self.attack}
        rng = np.random.default_rng([self.seed, _SALT_BYZ, plan])
        chosen = np.sort(rng.choice(len(participants), size=min(self.k, len(participants)), replace=False))
        return {int(participants[j]): self.names[i % len(self.names)] for i, j in enumerate(chosen)}

    def lie(self, client: int, scalars: np.ndarray, plan: int, attack: str | None = None) -> np.ndarray:
        """What Byzantine ``client`` sends instead of its honest ``scalars`` (float32), by
        ``attack`` (default: the client's own)."""
        g = np.asarray(scalars, dtype=np.float32)
        a = attack or self.attack[client]
        if a == "scale":
            return (g * np.float32(self.scale)).astype(np.float32)
        if a == "sign-flip":
            return -g
        if a == "nan":
            return np.full_like(g, np.nan)
        rms = float(np.sqrt(np.mean(g.astype(np.float64) ** 2))) or 1.0
        rng = np.random.default_rng([self.seed, _SALT_ATTACK, plan, client])
        return (rng.standard_normal(g.shape) * self.scale * rms).astype(np.float32)
