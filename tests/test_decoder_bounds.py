"""The decoders' bounds that random bytes rarely reach, pinned by Hypothesis ``@example``s: a
b-bit code of 2^b - 1 (no encoder makes it: codes run -L..L, L = 2^(b-1) - 1), a set pad bit
after the last code, and a non-canonical varint (0 in two bytes). Whatever the decoder accepts
is what an encoder could have written."""

import os
import struct

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import example, given, settings, strategies as st  # noqa: E402

from hiso.core.errors import MessageError  # noqa: E402
from hiso.core.scalars import CODE_BITS, codes_size, decode_codes  # noqa: E402
from hiso.core.wire import get_varint, put_varint  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("HISO_FUZZ_EXAMPLES", "60")), deadline=None, database=None)
ONE = struct.pack("<f", 1.0)


@st.composite
def code_blocks(draw):
    bits, rows, cols = draw(st.sampled_from(CODE_BITS)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    scales = b"".join(struct.pack("<f", draw(st.floats(0, 1e3, width=32))) for _ in range(rows))
    size = codes_size(rows, cols, bits) - len(scales)
    return bits, rows, cols, scales + draw(st.binary(min_size=size, max_size=size))


@FUZZ
@given(code_blocks())
@example((2, 1, 1, ONE + bytes([0b11])))  # the 2-bit code 3 = 2^2 - 1
@example((4, 1, 1, ONE + bytes([0x0F])))  # the 4-bit code 15
@example((8, 1, 1, ONE + bytes([0xFF])))  # the 8-bit code 255
@example((2, 1, 1, ONE + bytes([0b101])))  # code 1 (zero), and a pad bit set
@example((1, 1, 3, ONE + bytes([0b1000])))  # three signs, a pad bit set
def test_accepted_codes_are_an_encoders(case):
    bits, rows, cols, raw = case
    try:
        x = decode_codes(raw, 0, rows, cols, bits)
    except ValueError:
        return
    n = rows * cols
    planes = np.unpackbits(np.frombuffer(raw, np.uint8, offset=4 * rows), bitorder="little")
    assert not planes[n * bits:].any(), "a pad bit was set"
    u = (planes[:n * bits].reshape(n, bits).astype(np.int64) << np.arange(bits)).sum(axis=1)
    if bits > 1:
        assert u.max() <= 2 * (2 ** (bits - 1) - 1), "a code no encoder makes"
    assert x.shape == (rows, cols) and np.all(np.isfinite(x))


def _varint(v: int) -> bytes:
    out = bytearray()
    put_varint(out, v)
    return bytes(out)


@FUZZ
@given(st.one_of(st.binary(max_size=12), st.integers(0, 2**64 - 1).map(_varint)))
@example(b"\x80\x00")  # 0 in two bytes
@example(b"\xff\x00")  # 127 in two bytes
@example(b"\x81\x80\x00")  # 1 in three bytes
def test_accepted_varints_are_canonical(data):
    try:
        v, end = get_varint(data, 0, "test")
    except MessageError:
        return
    assert data[:end] == _varint(v)
