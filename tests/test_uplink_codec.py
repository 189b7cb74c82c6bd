"""A method's own uplink codec (hiso.core.uplink): written here as a user would, run through the
simulator with its bytes counted, its decoder's refusals, the built-in names and one-line errors."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import hiso
from hiso.core.config import ZOConfig
from hiso.core.messages import Hello, MessageError, Uplink, Wire, decode_uplink, encode_hello, encode_uplink
from hiso.core.method import Method
from hiso.core.uplink import SCALARS, Codes, uplink_codec
from hiso.methods.feedsign import SIGNS, FeedSign
from hiso.methods.greedy import CHOICE, Greedy

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods-api.md"


@dataclass(frozen=True)
class Top1:
    """Each row of the answer as its one nonzero's index (a byte) and value (a float16), whatever
    the run's scalar dtype: 3 bytes a local step."""

    name = "top1"

    def size(self, wire):
        return 3 * wire.tau

    def encode(self, scalars, wire, check=True):
        x = np.asarray(scalars, np.float32)
        idx = np.argmax(np.abs(x), axis=1)
        vals = x[np.arange(wire.tau), idx]
        with np.errstate(over="ignore"):
            half = vals.astype("<f2")
        if check and np.any(np.count_nonzero(x, axis=1) > 1):
            raise ValueError("top1: a row has more than one nonzero value")
        if check and not np.array_equal(half.astype(np.float32), vals):
            raise ValueError("top1: a value is not a float16 number")
        return idx.astype("<u1").tobytes() + half.tobytes()

    def decode(self, data, off, wire):
        idx = np.frombuffer(data, "<u1", wire.tau, off).astype(np.int64)
        vals = np.frombuffer(data, "<f2", wire.tau, off + wire.tau).astype(np.float32)
        if np.any(idx >= wire.P):
            raise ValueError(f"top1: an index past the {wire.P} columns")
        if np.any((vals == 0) & (idx != 0)):
            raise ValueError("top1: a zero at an index other than 0 (not one the encoder makes)")
        out = np.zeros(wire.shape, np.float32)
        out[np.arange(wire.tau), idx] = vals
        return out


TOP1 = Top1()


@dataclass(frozen=True)
class Top1Half(Method):
    """A client keeps a step's largest |g| as a float16 and sends it with its index (Top1)."""

    display = "Top1Half"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset()
    uplink = TOP1

    def step_scalars(self, g):
        out = np.zeros_like(g)
        j = int(np.argmax(np.abs(g)))
        out[j] = np.float32(np.float16(g[j]))
        return out


def test_a_method_with_its_own_codec_runs_and_its_uplinks_are_the_codecs_bytes(tmp_path):
    run = hiso.run("quadratic", tmp_path / "r", algorithm=Top1Half(), dim=30, clients=2, sampled=2,
                   perturbations=8, lr=0.05, rounds=3, eval_every=3, threads=1)
    summary = json.loads((Path(run.dir) / "summary.json").read_text())
    zo = ZOConfig(lr=0.05, perturbations=8, method=Top1Half())
    wire = Wire.of(zo, 0)
    assert wire.uplink is TOP1 and wire.uplink_bytes == 3
    g = np.zeros((1, 8), np.float32)
    g[0, 5] = -0.5
    up = encode_uplink(Uplink(1, 2, g, 0.25), wire)
    # header 6 (version, kind, flags, client, round, attempt), index 1 + float16 2, float32 loss 4
    assert len(up) == 6 + 3 + 4  # float32 scalars would be 6 + 32 + 4
    hello = len(encode_hello(Hello(0, 0)))
    assert summary["communication_per_client"]["bytes_up_mean"] == hello + 3 * len(up)


def test_the_decoder_refuses_what_the_codec_would_not_make():
    wire = Wire(2, 8, "bfloat16", uplink=TOP1)
    g = np.zeros((2, 8), np.float32)
    g[0, 5], g[1, 0] = -1.5, 0.25
    data = encode_uplink(Uplink(3, 7, g, 0.5), wire)
    head = 6
    assert data[head:head + 2] == bytes([5, 0]) and len(data) == head + 6 + 2  # float16 values, bfloat16 loss
    back = decode_uplink(data, wire)
    assert np.array_equal(back.scalars, g) and back.loss == 0.5 and back.client == 3
    nan16 = np.array([np.nan], "<f2").tobytes()
    for bad, words in ((data[:-1], "truncated or padded"), (data + b"\0", "truncated or padded"),
                       (data[:head] + bytes([8]) + data[head + 1:], "client 3: top1: an index past the 8 columns"),
                       (data[:head + 1] + bytes([4]) + data[head + 2:head + 4] + bytes(2) + data[head + 6:],
                        "client 3: top1: a zero at an index other than 0"),
                       (data[:head + 2] + nan16 + data[head + 4:], "client 3: non-finite scalar")):
        with pytest.raises(MessageError, match=words):
            decode_uplink(bad, wire)
    with pytest.raises(ValueError, match="uplink from client 3: top1: a row has more than one nonzero"):
        encode_uplink(Uplink(3, 7, np.ones((2, 8), np.float32)), wire)
    with pytest.raises(ValueError, match="uplink from client 3: top1: a value is not a float16 number"):
        encode_uplink(Uplink(3, 7, np.full((2, 8), 0.1, np.float32) * np.eye(2, 8, dtype=np.float32)), wire)


def test_the_built_in_names_and_codecs_resolve():
    from hiso.methods.sketch import Sketch
    assert uplink_codec(None) is SCALARS and uplink_codec(Method()) is SCALARS
    assert uplink_codec(FeedSign()) is SIGNS and uplink_codec(Greedy()) is CHOICE
    sketch = Sketch(sketch_bits=2)
    assert uplink_codec(sketch) == Codes(2) and Wire(1, 5, uplink=uplink_codec(sketch)).uplink_bytes == 4 + 2
    assert uplink_codec(Top1Half()) is TOP1


@dataclass(frozen=True)
class _Named(Method):
    uplink = "choice"  # a name the core no longer has (greedy's codec is its own)


@dataclass(frozen=True)
class _Signs(Method):
    uplink = "signs"  # nor this one (FeedSign's codec is its own)


@dataclass(frozen=True)
class _Partial(Method):
    uplink = object()


@dataclass(frozen=True)
class _NoBits(Method):
    uplink = "codes"


@pytest.mark.parametrize("method, words", [
    (_Named(), "a method's uplink must be 'scalars', 'codes' or a codec (hiso.core.uplink), got 'choice'"),
    (_Signs(), "a method's uplink must be 'scalars', 'codes' or a codec (hiso.core.uplink), got 'signs'"),
    (_Partial(), "uplink codec (object) lacks name, size, encode, decode"),
    (_NoBits(), "a method with uplink 'codes' needs bits in (1, 2, 4, 8), got None"),
])
def test_a_bad_uplink_is_one_line(method, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        ZOConfig(lr=0.1, method=method)
    assert "\n" not in str(e.value)


def test_the_docs_example_codec_round_trips():
    page = DOCS.read_text()
    section = page[page.index("## Your own uplink codec"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOCS), "exec"), scope)
    method = scope["HalfUp"]()
    zo = ZOConfig(lr=0.1, perturbations=3, local_steps=2, method=method)
    wire = Wire.of(zo, 0)
    g = method.step_scalars(np.array([[0.1, -2.5, 3.0], [1e-3, 0.0, 7.0]], np.float32))
    data = encode_uplink(Uplink(0, 1, g, 1.0), wire)
    assert wire.uplink_bytes == 2 * 6 and len(data) == 6 + 12 + 4
    assert np.array_equal(decode_uplink(data, wire).scalars, g) and not np.array_equal(g[0, 0], np.float32(0.1))
