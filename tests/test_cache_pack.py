"""hiso cache pack / unpack: a cached model moved in checksummed parts, found by its short name
on the far side without its GGUF package; damaged packs refused with nothing written."""

import hashlib
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from lm_fixtures import write_sst2, write_tiny_lm  # noqa: E402

from hiso.tasks import lm  # noqa: E402
from hiso.tasks.lm_pack import PackError, parse_size  # noqa: E402

SHORT = "smollm2-135m"


def _no_gguf(short):
    raise AssertionError("the GGUF package was asked for")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny model in cache A under a short name, packed in 4 KiB parts."""
    root = tmp_path_factory.mktemp("pack")
    src = write_tiny_lm(root / "cacheA" / "models" / SHORT)
    mp = pytest.MonkeyPatch()
    mp.setenv("HISO_CACHE_DIR", str(root / "cacheA"))
    mp.setattr(lm, "_gguf_file", _no_gguf)  # the cached directory is what is packed
    try:
        code, out, err = _cli(["cache", "pack", "--model", SHORT, "--out", str(root / "pack"),
                               "--part-size", "4K", "--quiet"])
    finally:
        mp.undo()
    assert code == 0, err
    return {"src": src, "pack": root / "pack", "root": root}


def _cli(args):
    from hiso.cli import main
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _tree(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_part_sizes_parse_and_bad_ones_are_refused():
    assert parse_size("60M") == 60 * 2**20
    assert parse_size("1G") == 2**30
    assert parse_size("1.5G") == 3 * 2**29
    assert parse_size("512k") == 512 * 1024
    assert parse_size("60MiB") == parse_size("60MB") == 60 * 2**20
    assert parse_size("4096") == 4096
    for bad in ("", "M", "abc", "-5M", "0", "60X", "1.2.3M", "100", "5 M B", "12iB"):
        with pytest.raises(PackError):
            parse_size(bad)


def test_bad_part_size_on_the_command_line_writes_nothing(packed, tmp_path):
    code, _, err = _cli(["cache", "pack", "--model", str(packed["src"]), "--out", str(tmp_path / "p"),
                         "--part-size", "60X"])
    assert code == 2 and err.startswith("hiso: error:") and err.count("\n") == 1
    assert not (tmp_path / "p").exists()


def test_parts_respect_the_size_and_the_manifest_holds_every_checksum(packed):
    m = json.loads((packed["pack"] / "manifest.json").read_text())
    assert m["model"] == SHORT and m["hiso_version"] and m["part_size"] == 4096
    assert len(m["parts"]) > 2
    stream = b""
    for p in m["parts"]:
        data = (packed["pack"] / p["name"]).read_bytes()
        assert len(data) == p["size"] <= 4096
        assert hashlib.sha256(data).hexdigest() == p["sha256"]
        stream += data
    src = _tree(packed["src"])
    assert [f["path"] for f in m["files"]] == sorted(src)
    for f in m["files"]:  # the parts are the files in order, each checksummed
        assert stream[:f["size"]] == src[f["path"]]
        assert hashlib.sha256(src[f["path"]]).hexdigest() == f["sha256"]
        stream = stream[f["size"]:]
    assert stream == b""


def test_round_trip_into_a_fresh_cache_is_found_by_its_short_name(packed, tmp_path, monkeypatch):
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cacheB"))
    monkeypatch.setattr(lm, "_gguf_file", _no_gguf)  # no GGUF package on the far side
    code, out, err = _cli(["cache", "unpack", str(packed["pack"]), "--quiet"])
    assert code == 0, err
    target = tmp_path / "cacheB" / "models" / SHORT
    assert str(target) in out and f"--model {SHORT}" in out
    assert _tree(target) == _tree(packed["src"])  # byte-identical files
    assert [p.name for p in target.parent.iterdir()] == [SHORT]  # no temporary directory left
    assert lm.resolve_model(SHORT) == str(target)
    ids = torch.tensor([[3, 9, 12, 20, 7]])
    with torch.no_grad():
        want = lm.load_model("a", str(packed["src"]))(ids).logits
        got = lm.load_model(SHORT, lm.resolve_model(SHORT))(ids).logits
    assert torch.equal(got, want)
    # the same pack again: nothing to do
    code, out, err = _cli(["cache", "unpack", str(packed["pack"]), "--quiet"])
    assert code == 0 and "already unpacked" in out


def test_hiso_run_finds_the_unpacked_model_by_its_short_name(packed, tmp_path, monkeypatch):
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cacheB"))
    monkeypatch.setattr(lm, "_gguf_file", _no_gguf)
    assert _cli(["cache", "unpack", str(packed["pack"]), "--quiet"])[0] == 0
    data = write_sst2(tmp_path / "sst2")
    code, _, err = _cli(["run", "--task", "sst2", "--model", SHORT, "--data-dir", str(data),
                         "--label-words", " terrible, great", "--clients", "2", "--sampled", "1",
                         "--rounds", "1", "--eval-every", "1", "--min-size", "2", "--batch-size", "2",
                         "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 0, err


def _flip(d, name):
    p = d / name
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 1
    p.write_bytes(bytes(b))


def _manifest(d, change):
    m = json.loads((d / "manifest.json").read_text())
    change(m)
    (d / "manifest.json").write_text(json.dumps(m))


DAMAGE = {
    "flipped bit in a part": (lambda d, m: _flip(d, m["parts"][1]["name"]), "damaged"),
    "truncated part": (lambda d, m: (d / m["parts"][0]["name"]).write_bytes(b"x"), "damaged"),
    "missing part": (lambda d, m: (d / m["parts"][-1]["name"]).unlink(), "missing"),
    "extra file": (lambda d, m: (d / "stray.part9999").write_bytes(b"x"), "does not list"),
    "manifest not JSON": (lambda d, m: (d / "manifest.json").write_text("{"), "JSON"),
    "manifest of something else": (lambda d, m: _manifest(d, lambda x: x.update(format="zip")), "format"),
    "file checksum changed": (lambda d, m: _manifest(d, lambda x: x["files"][-1].update(sha256="0" * 64)),
                              "wrong SHA-256"),
    "path outside the target": (lambda d, m: _manifest(d, lambda x: x["files"][0].update(path="../evil")),
                                "relative path"),
    "sizes disagree": (lambda d, m: _manifest(d, lambda x: x["parts"][0].update(size=x["parts"][0]["size"] + 1)),
                       "disagree"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_pack_is_refused_with_one_line_and_nothing_written(packed, tmp_path, monkeypatch, case):
    pack = tmp_path / "pack"
    shutil.copytree(packed["pack"], pack)
    damage, words = DAMAGE[case]
    damage(pack, json.loads((pack / "manifest.json").read_text()))
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cacheB"))
    code, out, err = _cli(["cache", "unpack", str(pack), "--quiet"])
    assert code == 2 and out == ""
    assert err.startswith("hiso: error:") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "cacheB").exists()
    code, _, err = _cli(["cache", "unpack", str(pack), "--to", str(tmp_path / "elsewhere" / "m"), "--quiet"])
    assert code == 2 and not (tmp_path / "elsewhere").exists()


def test_an_existing_different_target_is_left_alone(packed, tmp_path):
    target = tmp_path / "models" / "m"
    write_tiny_lm(target, seed=1)  # other weights
    before = _tree(target)
    code, _, err = _cli(["cache", "unpack", str(packed["pack"]), "--to", str(target), "--quiet"])
    assert code == 2 and "differs" in err and err.count("\n") == 1
    assert _tree(target) == before and [p.name for p in target.parent.iterdir()] == ["m"]


def test_pack_refuses_a_non_empty_out_and_a_non_model(packed, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = _cli(["cache", "pack", "--model", str(packed["src"]), "--out", str(tmp_path / "full")])
    assert code == 2 and "not an empty directory" in err and err.count("\n") == 1
    code, _, err = _cli(["cache", "pack", "--model", str(tmp_path / "full"), "--out", str(tmp_path / "p")])
    assert code == 2 and "config.json" in err and not (tmp_path / "p").exists()
    code, _, err = _cli(["cache", "pack", "--model", "no/such/model", "--out", str(tmp_path / "p")])
    assert code == 2 and "nothing to pack" in err and not (tmp_path / "p").exists()


# ---------------------------------------------------------------- --gguf: the GGUF travels, dequantized there


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A short name whose 'GGUF' dequantizes to the tiny model ``tmp_path/dequant`` (the loader is
    pointed at that directory, as test_language's cache test does): the packing and checking are
    real, the dequantization is the tiny model's loading. Returns a function that sets what the
    dequantization yields (another seed: other weights)."""
    write_tiny_lm(tmp_path / "cacheA" / "models" / SHORT)
    gguf = tmp_path / "ggufsrc" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(bytes(range(256)) * 40)
    monkeypatch.setattr(lm, "_gguf_file", lambda short: gguf)
    model_fn, tok_fn = lm._model, lm._tokenizer
    monkeypatch.setattr(lm, "_model", lambda src, gguf_file=None: model_fn(tmp_path / "dequant"))
    monkeypatch.setattr(lm, "_tokenizer", lambda src, gguf_file=None: tok_fn(tmp_path / "dequant"))

    def dequantizes_to(seed):
        shutil.rmtree(tmp_path / "dequant", ignore_errors=True)
        write_tiny_lm(tmp_path / "dequant", seed=seed)
    dequantizes_to(0)
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cacheA"))
    code, _, err = _cli(["cache", "pack", "--model", SHORT, "--out", str(tmp_path / "pack"), "--gguf",
                         "--part-size", "4K", "--quiet"])
    assert code == 0, err
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cacheB"))
    return dequantizes_to


def test_a_gguf_pack_carries_the_gguf_and_is_dequantized_and_checked_there(fake_gguf, tmp_path):
    m = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert m["gguf"] == "gguf/tiny.gguf" and not any(f["path"].endswith(".safetensors") for f in m["files"])
    code, out, err = _cli(["cache", "unpack", str(tmp_path / "pack"), "--quiet"])
    assert code == 0, err
    src, target = _tree(tmp_path / "cacheA" / "models" / SHORT), _tree(tmp_path / "cacheB" / "models" / SHORT)
    assert sorted(target) == sorted(src) and all(target[k] == src[k] for k in src if not k.endswith(".safetensors"))
    ids = torch.tensor([[3, 9, 12, 20, 7]])
    with torch.no_grad():
        from transformers import AutoModelForCausalLM
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "cacheA" / "models" / SHORT)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(lm.resolve_model(SHORT))(ids).logits
    assert torch.equal(a, b)
    assert [p.name for p in (tmp_path / "cacheB" / "models").iterdir()] == [SHORT]
    code, out, _ = _cli(["cache", "unpack", str(tmp_path / "pack"), "--quiet"])
    assert code == 0 and "already unpacked" in out


def test_a_gguf_dequantized_to_other_weights_is_refused(fake_gguf, tmp_path):
    fake_gguf(1)  # this machine's dequantization gives other numbers
    code, out, err = _cli(["cache", "unpack", str(tmp_path / "pack"), "--quiet"])
    assert code == 2 and err.startswith("hiso: error:") and err.count("\n") == 1 and "without --gguf" in err
    assert not (tmp_path / "cacheB" / "models" / SHORT).exists()
    assert list((tmp_path / "cacheB" / "models").iterdir()) == []  # no temporary directory left either


def test_gguf_packs_only_short_names(packed, tmp_path):
    code, _, err = _cli(["cache", "pack", "--model", str(packed["src"]), "--out", str(tmp_path / "p"), "--gguf"])
    assert code == 2 and "short name" in err and not (tmp_path / "p").exists()
