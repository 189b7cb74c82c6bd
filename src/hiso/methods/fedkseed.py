"""FedKSeed (Qin et al., ICML 2024, arXiv 2312.06353): ZO local steps over a fixed pool of K seeds.

* The pool: K seeds fixed for the run, derived from the run seed (``pool_seeds``; SplitMix64 of
  the index under a key of its own, so pool seeds never coincide with the rounds' seeds by design).
* Local step k of client i in round r: an index j_k drawn from the pool with probabilities p_r,
  a two-point estimate g_k = (f_i(x + mu z_j) - f_i(x - mu z_j)) / (2 mu) on the step's minibatch,
  x <- x - eta g_k z_j (the local iterate; :func:`hiso.core.estimator.local_update` with P = 1).
  The client uploads its tau (j_k, g_k) pairs.
* Probabilities (FedKSeed-Pro's probability-differentiated sampling), as the authors' code
  computes them (FedKSeed's ``Server.calculate_probabilities``, carried by Ferret's public
  repository and FATE-LLM's port): each seed's history starts with one ``grad_initial`` = 0 and
  collects every scalar uploaded for it; psi_j = mean |clip(history_j, +-bias_loss_clip)|
  (clip 1000, their default: in effect no clip), i.e. sum |g| / (count_j + 1);
  psi <- (psi - min psi) / (max psi + 1e-10 - min psi), p = softmax(psi). With
  ``sampling="uniform"`` p = 1/K (plain FedKSeed). Every replica computes p from the log alone.
* Server: the record of round r is every participant's pairs; the global step is
  x_{r+1} = x_r - eta_r sum_j a_{r,j} z_j, a_{r,j} = (1/n) sum_{i,k: j_{i,k} = j} g_{i,k}.

Defaults and where ours differ from the authors' code (its ``main.py``): K = 4096 (``-K``, as
here); zo_eps 5e-4 (our ``mu`` defaults to 1e-3: pass ``--mu 5e-4``); 200 local steps and batch
size 1 on their LLM runs (``--local-steps``); clients weighted by data size unless
``--equal_weight`` (here the plain mean: ``--weighted`` is refused for fedkseed); each client's
local steps start from the global model of the round (as here), and their server rebuilds x_r
from x_0 over every seed with a nonzero accumulated scalar (as here). Downlink: the paper's client
pulls the K accumulated scalars (4K bytes, the 16 KB of its "under 18 KB"); ours sends the rounds
the client missed, every participant's tau (index, scalar) pairs (exact, and smaller while a client
missed fewer than about 4K / (n (6 tau + 1)) rounds of n clients; beyond, it grows with them).

Exactness with K regenerations at most: a replica does not step round by round. It folds
records into C_j = sum_r eta_r a_{r,j} (float64, in log order: cheap, no direction is drawn)
and then *materialises* x_r = x_0 - sum_j c_j z_j, c_j = float32(C_j), summed over j ascending
by one :meth:`~hiso.core.directions.DirectionGenerator.combine` per tensor and added to x_0 once.
So a client that missed any number of rounds draws each pool direction at most once, and the
server, every client and ``hiso rebuild`` hold the same bits whatever rounds each of them
skipped. The price: every replica keeps x_0's trainable tensors (one copy).

Wire (``encode_pool_uplink`` / ``encode_pool_downlink``; varints as in :mod:`hiso.core.messages`):
uplink ``version, 6, flags, client, round``, tau u16 seed indices, tau scalars, the loss
(flags & 1); downlink ``version, 7, round, n_missed`` then per missed round ``n, n
participants, n*tau u16 indices, n*tau scalars``. Indices are u16: K <= 65536.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core import exact
from ..core.config import ZOConfig
from ..core.messages import MessageError, decode_scalars, encode_scalars, get_varint, put_varint, quantize
from ..core.scalars import SCALAR_BYTES
from ..core.seeds import MASK, mix64
from ..core.state import ModelState
from ..core.wire import read_head as _head
from ..core.wire import start as _start

DEFAULT_POOL = 4096  # K: the authors' main.py default (-K 4096), that of the paper's LLM runs
GRAD_INITIAL = 0.0  # each seed's amplitude history starts with this value (the authors' --grad_initial)
AMP_CLIP = 1000.0  # |g| is clipped at this before averaging (the authors' --bias_loss_clip default)
MAX_POOL = 1 << 16  # seed indices travel as u16
SAMPLING = ("weighted", "uniform")  # FedKSeed-Pro's probabilities, or plain FedKSeed's uniform draw
_DOMAIN = 0x6869736F2D706F6F  # b"hiso-poo"
POOL_UP, POOL_DOWN = 6, 7
FLAG_LOSS = 1


def check_pool(K: int) -> None:
    if not 1 <= K <= MAX_POOL:
        raise ValueError(f"seed pool must hold 1 to {MAX_POOL} seeds (indices are 16-bit on the wire), got {K}")


def pool_seeds(run_seed: int, K: int) -> np.ndarray:
    """The run's K candidate seeds (uint64)."""
    check_pool(K)
    key = mix64((run_seed ^ _DOMAIN) & MASK)
    return np.array([mix64(j ^ key) for j in range(K)], dtype=np.uint64)


def probabilities(amp: np.ndarray, count: np.ndarray, sampling: str = "weighted") -> np.ndarray:
    """p over the pool from the summed clipped |g| and the number of scalars per seed (float64);
    each seed's history also holds GRAD_INITIAL, so its mean is (GRAD_INITIAL + amp) / (count + 1)."""
    K = len(amp)
    if sampling == "uniform":
        return np.full(K, 1.0 / K)
    psi = (abs(GRAD_INITIAL) + np.asarray(amp, dtype=np.float64)) / (np.asarray(count, dtype=np.float64) + 1.0)
    psi = (psi - psi.min()) / (psi.max() + 1e-10 - psi.min())
    e = np.exp(psi - psi.max())
    return e / e.sum()


def draw_indices(p: np.ndarray, run_seed: int, round: int, client: int, tau: int) -> np.ndarray:
    """Client ``client``'s tau pool indices of round ``round`` (its own stream; the indices are uploaded)."""
    rng = np.random.default_rng([run_seed, round, client, 0x6B5EED])
    return rng.choice(len(p), size=tau, p=p).astype(np.int64)


@dataclass(frozen=True)
class PoolRecord:
    """Round ``round``: each participant's tau (index, scalar) pairs, participants in order."""

    round: int
    participants: tuple[int, ...]
    idx: np.ndarray  # (n, tau) int64
    g: np.ndarray  # (n, tau) float32, values of the scalar dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "idx", np.asarray(self.idx, dtype=np.int64))
        object.__setattr__(self, "g", np.asarray(self.g, dtype=np.float32))
        if self.idx.shape != self.g.shape or self.idx.shape[0] != len(self.participants):
            raise ValueError(f"record {self.round}: indices {self.idx.shape}, scalars {self.g.shape} for "
                             f"{len(self.participants)} participants")


class PoolReplica:
    """A replica of FedKSeed's state: x_0, the folded coefficients C and the |g| statistics,
    and the model (materialised x_r, in ``state``) with its direction generator."""

    def __init__(self, model: torch.nn.Module, zo: ZOConfig, K: int, run_seed: int, sampling: str = "weighted"):
        if sampling not in SAMPLING:
            raise ValueError(f"seed sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
        self.state = ModelState(model, zo)
        self.K, self.sampling, self.tau = K, sampling, zo.local_steps
        self.seeds = pool_seeds(run_seed, K)
        self.x0 = [p.detach().clone() for p in self.state.params]
        self.coef = np.zeros(K)  # C_j = sum_r eta_r a_{r,j}
        self.amp = np.zeros(K)  # sum of min(|g|, AMP_CLIP) per seed
        self.count = np.zeros(K, dtype=np.int64)
        self.round = 0  # rounds folded
        self.regenerations = 0  # pool directions drawn by materialise() (each covers every tensor)

    def fold(self, rec: PoolRecord) -> None:
        """Account for round ``rec.round`` (no direction is drawn)."""
        if rec.round != self.round:
            raise ValueError(f"replica is at round {self.round}, cannot fold record of round {rec.round}")
        if rec.idx.shape[1:] != (self.tau,) or rec.idx.size and not 0 <= rec.idx.min() <= rec.idx.max() < self.K:
            raise ValueError(f"record {rec.round}: indices outside the pool of {self.K} or not {self.tau} per client")
        a = np.zeros(self.K)
        np.add.at(a, rec.idx.ravel(), rec.g.ravel().astype(np.float64))
        self.coef += self.state.cfg.lr_at(rec.round) * (a / len(rec.participants))
        np.add.at(self.amp, rec.idx.ravel(), np.minimum(np.abs(rec.g.ravel().astype(np.float64)), AMP_CLIP))
        np.add.at(self.count, rec.idx.ravel(), 1)
        self.round += 1

    def p(self) -> np.ndarray:
        return probabilities(self.amp, self.count, self.sampling)

    @torch.no_grad()
    def materialise(self) -> None:
        """x_round = x_0 - sum_j float32(C_j) z_j (j ascending, one combine per tensor)."""
        js = np.flatnonzero(self.coef)
        if len(js):
            c = (-self.coef[js]).astype(np.float32).astype(np.float64) * len(js)  # combine divides by len: exact
            seeds = self.seeds[js]
        for i, p in enumerate(self.state.params):
            p.copy_(self.x0[i])
            if len(js):
                exact.axpy_(p, 1.0, self.state.gen.combine(i, p.shape, seeds, c, None, p.device))
        self.regenerations += len(js)
        self.state.round = self.round

    def catch_up(self, records) -> None:
        for rec in records:
            self.fold(rec)
        self.materialise()

    def state_dict(self) -> dict:
        return {**self.state.state_dict(), "seed_pool": {"coef": torch.from_numpy(self.coef.copy()),
                                                          "amp": torch.from_numpy(self.amp.copy()),
                                                          "count": torch.from_numpy(self.count.copy())}}


# ------------------------------------------------------------------------------ wire


def _pairs(idx: np.ndarray, g: np.ndarray, dtype: str) -> bytes:
    return np.asarray(idx, dtype="<u2").tobytes() + encode_scalars(g, dtype)


def encode_pool_uplink(client: int, round: int, idx, g, loss: float | None, dtype: str = "float32") -> bytes:
    out = _start(POOL_UP)
    put_varint(out, FLAG_LOSS if loss is not None else 0)
    put_varint(out, client)
    put_varint(out, round)
    out += _pairs(idx, g, dtype)
    if loss is not None:
        out += encode_scalars(np.array([loss]), dtype)
    return bytes(out)


def decode_pool_uplink(data, tau: int, K: int, dtype: str = "float32"):
    """(client, round, idx (tau,), g (tau,), loss or None); checked whole before it is returned."""
    what = "pool uplink"
    off = _head(data, POOL_UP, what)
    flags, off = get_varint(data, off, what)
    if flags & ~FLAG_LOSS:
        raise MessageError(f"{what}: unknown flags {flags:#x}")
    client, off = get_varint(data, off, what)
    rnd, off = get_varint(data, off, what)
    sb = SCALAR_BYTES[dtype]  # (fixed-width formats only: FedKSeed refuses int8)
    end = off + tau * (2 + sb) + (sb if flags & FLAG_LOSS else 0)
    if end != len(data):
        raise MessageError(f"{what} from client {client}: {len(data)} bytes, expected {end}")
    idx = np.frombuffer(data, "<u2", tau, off).astype(np.int64)
    g = decode_scalars(data, off + 2 * tau, tau, dtype)
    if idx.size and idx.max() >= K:
        raise MessageError(f"{what} from client {client}: seed index {int(idx.max())} outside the pool of {K}")
    if not np.all(np.isfinite(g)):
        raise MessageError(f"{what} from client {client}: non-finite scalar (diverged? lower lr or mu)")
    loss = float(decode_scalars(data, off + tau * (2 + sb), 1, dtype)[0]) if flags & FLAG_LOSS else None
    if loss is not None and not np.isfinite(loss):  # (one client's NaN would end the run as diverged)
        raise MessageError(f"{what} from client {client}: non-finite loss {loss}")
    return client, rnd, idx, g, loss


def encode_pool_downlink(round: int, missed, dtype: str = "float32") -> bytes:
    out = _start(POOL_DOWN)
    put_varint(out, round)
    put_varint(out, len(missed))
    for rec in missed:
        put_varint(out, len(rec.participants))
        for c in rec.participants:
            put_varint(out, c)
        out += _pairs(rec.idx.ravel(), rec.g.ravel(), dtype)
    return bytes(out)


def decode_pool_downlink(data, tau: int, K: int, dtype: str = "float32") -> tuple[int, list[PoolRecord]]:
    what = "pool downlink"
    off = _head(data, POOL_DOWN, what)
    rnd, off = get_varint(data, off, what)
    n, off = get_varint(data, off, what)
    if n > rnd:
        raise MessageError(f"{what} for round {rnd}: {n} records reach back before round 0")
    sb = SCALAR_BYTES[dtype]  # (fixed-width formats only: FedKSeed refuses int8)
    recs = []
    for j in range(n):
        m, off = get_varint(data, off, what)
        parts = []
        for _ in range(m):
            c, off = get_varint(data, off, what)
            parts.append(c)
        k = m * tau
        if off + k * (2 + sb) > len(data):
            raise MessageError(f"{what}: truncated")
        idx = np.frombuffer(data, "<u2", k, off).astype(np.int64).reshape(m, tau)
        g = decode_scalars(data, off + 2 * k, k, dtype).reshape(m, tau)
        off += k * (2 + sb)
        if k and (idx.max() >= K or not np.all(np.isfinite(g))):
            raise MessageError(f"{what}: record {j} has an index outside the pool or a non-finite scalar")
        recs.append(PoolRecord(rnd - n + j, tuple(parts), idx, g))
    if off != len(data):
        raise MessageError(f"{what}: {len(data)} bytes, expected {off}")
    return rnd, recs


# ------------------------------------------------------------------------------ the log


MAGIC = b"HSOK"
_HEAD = struct.Struct("<4sBHIQB")  # magic, version 1, tau, K, run seed, scalar dtype code
DTYPES = ("float32", "float16", "bfloat16")


class PoolLogWriter:
    """``history.bin`` of a FedKSeed run: a header, then per round varint round, varint n,
    n varint participants, n*tau u16 indices, n*tau scalars, u32 CRC-32 of the record.
    Each record is flushed and fsynced before the round counts as done."""

    def __init__(self, path, tau: int, K: int, seed: int, dtype: str = "float32", fsync: bool = True,
                 keep: list[PoolRecord] | None = None):
        """``keep``: a resumed run's kept records, written again first (their encoding is
        deterministic: the same bytes as the interrupted run's, a torn tail dropped)."""
        self.tau, self.K, self.dtype, self.fsync, self.round = tau, K, dtype, fsync, 0
        head = _HEAD.pack(MAGIC, 1, tau, K, seed, DTYPES.index(dtype))
        for rec in keep or ():
            head += self._encode(rec)
            self.round += 1
        from ..atomic import write_atomic
        write_atomic(path, head)  # replaced whole: a kill here leaves the old log or the kept one
        self._f = open(path, "ab")

    def _sync(self) -> None:
        self._f.flush()
        if self.fsync:
            import os
            os.fsync(self._f.fileno())

    def write(self, rec: PoolRecord) -> None:
        if rec.round != self.round:
            raise ValueError(f"record {rec.round} out of sequence (expected {self.round})")
        if not np.array_equal(quantize(rec.g, self.dtype), rec.g):
            raise ValueError(f"record {rec.round}: scalars are not {self.dtype} values")
        self._f.write(self._encode(rec))
        self._sync()
        self.round += 1

    def _encode(self, rec: PoolRecord) -> bytes:
        body = bytearray()
        put_varint(body, rec.round)
        put_varint(body, len(rec.participants))
        for c in rec.participants:
            put_varint(body, c)
        body += _pairs(rec.idx.ravel(), rec.g.ravel(), self.dtype)
        return bytes(body) + struct.pack("<I", zlib.crc32(body))

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_pool_log(path) -> tuple[dict, list[PoolRecord]]:
    """(header, records) of a FedKSeed ``history.bin``; a torn last record is dropped."""
    data = Path(path).read_bytes()
    if len(data) < _HEAD.size or data[:4] != MAGIC:
        raise ValueError(f"{path}: not a FedKSeed history file")
    _, ver, tau, K, seed, code = _HEAD.unpack_from(data, 0)
    if ver != 1 or code >= len(DTYPES):
        raise ValueError(f"{path}: FedKSeed history version {ver}, scalar dtype code {code}: not one this hiso reads")
    dtype = DTYPES[code]
    sb = SCALAR_BYTES[dtype]  # (fixed-width formats only: FedKSeed refuses int8)
    off, recs = _HEAD.size, []
    while off < len(data):
        start = off
        try:
            rnd, off = get_varint(data, off, "record")
            m, off = get_varint(data, off, "record")
            parts = []
            for _ in range(m):
                c, off = get_varint(data, off, "record")
                parts.append(c)
        except MessageError:
            break
        k = m * tau
        end = off + k * (2 + sb) + 4
        if end > len(data) or struct.unpack_from("<I", data, end - 4)[0] != zlib.crc32(data[start:end - 4]):
            if end >= len(data):
                break
            raise ValueError(f"{path}: record {len(recs)} fails its checksum")
        if rnd != len(recs):
            raise ValueError(f"{path}: expected round {len(recs)}, found {rnd}")
        idx = np.frombuffer(data, "<u2", k, off).astype(np.int64).reshape(m, tau)
        g = decode_scalars(data, off + 2 * k, k, dtype).reshape(m, tau)
        recs.append(PoolRecord(rnd, tuple(parts), idx, g))
        off = end
    return {"tau": tau, "K": K, "seed": seed, "scalar_dtype": dtype}, recs
