"""A base held below float32 is read one tensor at a time (hiso.tasks.lm_stream) and holds the same
values, bit for bit, as the whole-file ``from_pretrained`` it replaces. Tiny LM, no downloads."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

from lm_fixtures import write_tiny_lm  # noqa: E402

from hiso.tasks import lm, lm_stream  # noqa: E402

DTYPES = ["bfloat16", "int8", "int4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # hidden 64: bitsandbytes' CPU 4-bit kernel packs output features in blocks of 32
    return write_tiny_lm(tmp_path_factory.mktemp("stream") / "lm", hidden=64, seed=3)


def _whole_file(path: Path, dtype: str):
    """The load before streaming: ``from_pretrained`` on the directory, then the embedding."""
    model = lm._model(path, **lm.base_precision(dtype))
    return lm.quantize_embeddings(model) if dtype in ("int8", "int4") else model


def _structure(model) -> list[tuple[str, str]]:
    return [(n, type(m).__name__) for n, m in model.named_modules()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_streamed_base_holds_the_whole_file_loads_values_bit_for_bit(tiny, dtype):
    old = _whole_file(tiny, dtype)
    new = lm.load_model(str(tiny), str(tiny), dtype)
    assert _structure(new) == _structure(old)
    state_old, state_new = lm.frozen_state(old), lm.frozen_state(new)
    assert state_new.keys() == state_old.keys() and len(state_new) > 0
    assert lm.fingerprint(state_new) == lm.fingerprint(state_old)
    ids = torch.tensor([[3, 9, 14, 20, 7, 11]])
    with torch.no_grad():
        assert torch.equal(new(input_ids=ids).logits, old(input_ids=ids).logits)
    assert new.generation_config.to_dict() == old.generation_config.to_dict()
    assert (new.name_or_path, new.config.to_dict()) == (old.name_or_path, old.config.to_dict())


def _resident_file_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_base_leaves_no_page_of_its_weight_file_resident(tiny, dtype):
    """A mapped file's pages count as the process's own once read: the whole-file load keeps the
    float32 model's size resident; the streamed one reads by pread, and the embedding rows it
    reads from the mapping are released once quantized."""
    weights = tiny / "model.safetensors"
    size_kib = weights.stat().st_size // 1024
    model = lm.load_model(str(tiny), str(tiny), dtype)
    assert _resident_file_kib(weights) <= 8  # at most the pages around the header
    old = _whole_file(tiny, dtype)
    assert _resident_file_kib(weights) > size_kib // 2
    del model, old


def test_release_mapped_drops_a_mapped_tensors_pages_and_leaves_others_alone(tiny, tmp_path):
    import shutil

    from safetensors import safe_open
    weights = Path(shutil.copy(tiny / "model.safetensors", tmp_path / "model.safetensors"))  # mapped here only
    own = torch.arange(4096, dtype=torch.float32)
    lm_stream.release_mapped(own)
    assert torch.equal(own, torch.arange(4096, dtype=torch.float32))
    with safe_open(str(weights), framework="pt", device="cpu", backend="mmap") as f:
        name = max(f.keys(), key=lambda k: f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[-1])
        t = f.get_slice(name)[...]
        before, kib = t.clone(), t.numel() * 4 // 1024
        resident = _resident_file_kib(weights)
        assert resident >= kib - 8
        lm_stream.release_mapped(t)
        assert _resident_file_kib(weights) <= resident - (kib - 8)  # (the kernel maps neighbouring pages too)
        assert torch.equal(t, before)  # read again from the file


def test_a_float32_base_and_a_model_without_safetensors_are_read_as_before(tiny, tmp_path):
    assert lm_stream.weight_files(tiny) == [tiny / "model.safetensors"]
    assert lm_stream.weight_files(tmp_path) is None
    model = lm.load_model(str(tiny), str(tiny), "float32")
    assert lm.fingerprint(lm.frozen_tensors(model)) == lm.fingerprint(lm.frozen_tensors(_whole_file(tiny, "float32")))
