"""Move a cached language model to a machine without the internet, in checksummed parts.

``hiso cache pack --model NAME --out DIR`` writes the directory the loader reads (for a short
name such as ``smollm2-135m``: its dequantized safetensors cache, built first if missing; or any
local ``from_pretrained`` directory) as parts of at most ``--part-size`` bytes plus
``manifest.json``. ``hiso cache unpack DIR`` puts it back into the model cache
(:func:`hiso.tasks.lm.cache_dir`), where ``--model NAME`` finds it with no GGUF package.

``--gguf`` packs a short name's GGUF file instead of its float32 weights (with the tokenizer:
SmolLM2-135M 97 MiB instead of 517, Gemma-3-270M 273 MiB instead of 1,055) and the fingerprint
of the weights dequantized on the packing machine; unpacking dequantizes it again (transformers and the
``gguf`` package needed there) and refuses weights whose fingerprint differs.

The files of the model directory, in sorted order, are concatenated into one byte stream that is
cut into parts (no compression: the dequantized float32 weights shrank only to 0.63-0.71 of
their size under zlib, lzma and byte shuffling, measured on SmolLM2-135M). The manifest records
every file's path, size and SHA-256, every part's name, size and SHA-256, the model's name and
the hiso version that packed it. Unpacking reads every part and checks every checksum (parts and
reassembled files) before it writes anything, then writes into a temporary directory beside the
target and renames it into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "hiso-model-pack"
FORMAT_VERSION = 1
DEFAULT_PART_SIZE = "60M"  # below the 64 MiB a GPU machine here receives per command
_CHUNK = 1 << 22
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PackError(ValueError):
    """A pack that cannot be written or trusted; the message is the one line a user sees."""


def parse_size(text: str) -> int:
    """Bytes of a part size such as ``60M``, ``1G``, ``1.5G``, ``512K`` or ``4096`` (K/M/G/T are
    powers of 1024; an optional ``B`` or ``iB`` may follow), at least 1K."""
    from ..config import parse_size as size_of

    try:
        size = size_of(text)
    except ValueError:
        raise PackError(f"part size must be a number of bytes with an optional K, M or G (e.g. 60M), got {text!r}") from None
    if size < 1024:
        raise PackError(f"part size must be at least 1K, got {text!r}")
    return size


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=quiet or total < (64 << 20))


def _source(model: str) -> tuple[str, Path]:
    """(name, directory) of what to pack: a short name's cache (built if missing) or a directory."""
    from . import lm

    if model in lm.SHORT_NAMES:
        lm._require_llm_extra()
        return model, lm._cache_gguf(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PackError(f"{model} holds no config.json: not a model directory from_pretrained reads")
        name = path.resolve().name
        if not _SAFE_NAME.match(name):
            raise PackError(f"model directory name {name!r} cannot name a cache entry (letters, digits, '.', '_', '-')")
        return name, path
    raise PackError(f"nothing to pack for model {model!r}: give a short name ({', '.join(lm.SHORT_NAMES)}) or a "
                    "local model directory (a hub model: download it to a directory first)")


def _files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or (not p.is_file() and not p.is_dir()):
            raise PackError(f"{p} is not a plain file: cannot pack it")
        if p.is_file():
            out.append(p)
    if not out:
        raise PackError(f"{root} holds no files")
    return out


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(d: Path) -> str:
    """:func:`hiso.tasks.lm.fingerprint` of every tensor in the directory's safetensors files."""
    from safetensors.torch import load_file

    from .lm import fingerprint

    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise PackError(f"{d} holds no safetensors weights")
    return fingerprint(tensors)


def pack(model: str, out: str | Path, part_size: int | str = DEFAULT_PART_SIZE, quiet: bool = False,
         gguf: bool = False) -> dict:
    """Write ``model``'s directory as parts and a manifest into ``out`` (new or empty); return the manifest.

    ``gguf``: a short name's GGUF file instead of its float32 weights (4-5x fewer bytes), with the
    fingerprint of the weights dequantized here; the far side dequantizes it again on unpacking
    (needs the ``gguf`` package there) and refuses weights with another fingerprint.
    """
    from .._version import __version__

    size = parse_size(part_size) if isinstance(part_size, str) else int(part_size)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackError(f"{out} exists and is not an empty directory")
    name, root = _source(model)
    files = _files(root)
    extra: dict = {}
    if gguf:
        from . import lm

        if model not in lm.SHORT_NAMES:
            raise PackError(f"--gguf packs a short name's GGUF file ({', '.join(lm.SHORT_NAMES)}), not {model!r}")
        source = lm._gguf_file(model)
        files = [f for f in files if f.suffix != ".safetensors" and not f.name.endswith(".safetensors.index.json")]
        extra = {"gguf": f"gguf/{source.name}", "weights_fingerprint": weights_fingerprint(root)}
        files.append(source)
    total = sum(p.stat().st_size for p in files)
    entries, parts = [], []
    out.mkdir(parents=True, exist_ok=True)
    part = part_hash = None
    part_len = 0

    def close_part() -> None:
        nonlocal part, part_len
        if part is not None:
            part.flush()
            os.fsync(part.fileno())  # on disk before the manifest that lists it
            part.close()
            parts.append({"name": Path(part.name).name, "size": part_len, "sha256": part_hash.hexdigest()})
            part, part_len = None, 0

    try:
        with _progress(total, f"packing {name}", quiet) as bar:
            for path in files:
                fh = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        fh.update(chunk)
                        bar.update(len(chunk))
                        while chunk:
                            if part is None:
                                part = open(out / f"{name}.part{len(parts):04d}", "wb")
                                part_hash = hashlib.sha256()
                            piece, chunk = chunk[:size - part_len], chunk[size - part_len:]
                            part.write(piece)
                            part_hash.update(piece)
                            part_len += len(piece)
                            if part_len == size:
                                close_part()
                rel = extra["gguf"] if extra and path.suffix == ".gguf" else path.relative_to(root).as_posix()
                entries.append({"path": rel, "size": path.stat().st_size, "sha256": fh.hexdigest()})
            close_part()
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": name, "hiso_version": __version__,
                    "part_size": size, "total_size": total, "files": entries, "parts": parts, **extra}
        from ..atomic import write_atomic
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")  # last: no manifest, no pack
    except BaseException:
        if part is not None:
            part.close()
        shutil.rmtree(out, ignore_errors=True)
        raise
    return manifest


def _check_manifest(m) -> dict:
    """The manifest if well formed (names safe to write, sizes consistent), else PackError."""
    def bad(why: str):
        raise PackError(f"{MANIFEST} is not a hiso model pack's manifest: {why}")

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        bad(f"format is not {FORMAT!r}")
    if m.get("format_version") != FORMAT_VERSION:
        bad(f"format_version {m.get('format_version')!r} (this hiso reads {FORMAT_VERSION})")
    if not isinstance(m.get("model"), str) or not _SAFE_NAME.match(m["model"]):
        bad("no valid model name")
    for key in ("files", "parts"):
        if not isinstance(m.get(key), list) or not m[key]:
            bad(f"no {key}")
        for e in m[key]:
            if not isinstance(e, dict) or not isinstance(e.get("size"), int) or isinstance(e["size"], bool) \
                    or e["size"] < 0 or not isinstance(e.get("sha256"), str) or not _HEX64.match(e["sha256"]):
                bad(f"an entry of {key} lacks a size or a SHA-256")
    for e in m["files"]:
        p = e.get("path")
        if not isinstance(p, str) or p.startswith("/") or "\\" in p or any(s in ("", ".", "..") for s in p.split("/")):
            bad(f"file path {p!r} is not a relative path inside the model directory")
    names = [e.get("name") for e in m["parts"]]
    if any(not isinstance(n, str) or not _SAFE_NAME.match(n) or n == MANIFEST for n in names) or len(set(names)) < len(names):
        bad("part names are not distinct plain file names")
    paths = [e["path"] for e in m["files"]]
    if len(set(paths)) < len(paths):
        bad("a file is listed twice")
    if "gguf" in m and (m["gguf"] not in paths or not m["gguf"].endswith(".gguf")
                        or not _HEX64.match(str(m.get("weights_fingerprint")))):
        bad("its gguf entry names no .gguf file of the pack or has no weights fingerprint")
    if not sum(e["size"] for e in m["files"]) == sum(e["size"] for e in m["parts"]) == m.get("total_size"):
        bad("the parts' sizes, the files' sizes and total_size disagree")
    return m


def read_manifest(src: str | Path) -> dict:
    src = Path(src)
    if not src.is_dir():
        raise PackError(f"{src} is not a directory")
    try:
        m = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise PackError(f"{src} holds no {MANIFEST}: not a hiso model pack") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise PackError(f"{src / MANIFEST} is not readable JSON: {e}") from None
    return _check_manifest(m)


def _stream(src: Path, m: dict, bar) -> Iterator[tuple[dict, bytes | None]]:
    """Yield (file entry, bytes) pieces of the reassembled files, then (entry, None) at each file's
    end, checking every part's SHA-256 and every file's SHA-256 (PackError on a mismatch)."""
    files = iter(m["files"])
    entry, left, fh = None, 0, None

    def next_file():
        nonlocal entry, left, fh
        entry = next(files, None)
        left, fh = (entry["size"], hashlib.sha256()) if entry else (0, None)

    def finish_files():  # files that end here (empty files included)
        while entry is not None and left == 0:
            if fh.hexdigest() != entry["sha256"]:
                raise PackError(f"file {entry['path']} reassembled from the parts has the wrong SHA-256")
            yield entry, None
            next_file()

    next_file()
    yield from finish_files()
    for p in m["parts"]:
        ph = hashlib.sha256()
        with open(src / p["name"], "rb") as f:
            while chunk := f.read(_CHUNK):
                ph.update(chunk)
                bar.update(len(chunk))
                while chunk:
                    if entry is None:
                        raise PackError(f"part {p['name']} is damaged: the parts hold more bytes than the files")
                    piece, chunk = chunk[:left], chunk[left:]
                    fh.update(piece)
                    left -= len(piece)
                    yield entry, piece
                    yield from finish_files()
        if ph.hexdigest() != p["sha256"]:
            raise PackError(f"part {p['name']} is damaged: its SHA-256 differs from the manifest's")
    if entry is not None:
        raise PackError(f"the parts end inside file {entry['path']}: a part is damaged")


def verify(src: str | Path, quiet: bool = False) -> dict:
    """Check a pack completely without writing: the manifest, that exactly its parts are there with
    their sizes, every part's and every reassembled file's SHA-256. Returns the manifest."""
    src = Path(src)
    m = read_manifest(src)
    expected = {p["name"]: p["size"] for p in m["parts"]}
    present = {p.name for p in src.iterdir()} - {MANIFEST}
    if missing := sorted(set(expected) - present):
        raise PackError(f"part {missing[0]} is missing from {src} ({len(missing)} of {len(expected)} missing)")
    if extra := sorted(present - set(expected)):
        raise PackError(f"{src} holds {extra[0]}, which its manifest does not list (a pack directory holds only "
                        "its parts and manifest.json)")
    for name, size in expected.items():
        if not (src / name).is_file():
            raise PackError(f"part {name} is not a file")
        if (got := (src / name).stat().st_size) != size:
            raise PackError(f"part {name} is damaged: {got} bytes, the manifest says {size}")
    with _progress(m["total_size"], "checking", quiet) as bar:
        for _ in _stream(src, m, bar):
            pass
    return m


def _same_files(target: Path, m: dict) -> bool:
    """Whether ``target`` holds the pack's model: its files (a GGUF pack: its other files and the
    fingerprint of the weights)."""
    gguf = m.get("gguf")
    have = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    want = [e for e in m["files"] if e["path"] != gguf]
    if gguf:
        have = [p for p in have if not p.endswith((".safetensors", ".safetensors.index.json"))]
    if have != sorted(e["path"] for e in want):
        return False
    if not all((target / e["path"]).stat().st_size == e["size"] and _sha(target / e["path"]) == e["sha256"]
               for e in want):
        return False
    return gguf is None or weights_fingerprint(target) == m["weights_fingerprint"]


def default_target(m: dict) -> Path:
    from .lm import cache_dir

    return cache_dir() / "models" / m["model"]


def reassemble(src: Path, m: dict, dest: Path, quiet: bool) -> None:
    """Reassemble the pack's files under ``dest`` (checking every checksum again as it goes)."""
    out = None
    try:
        with _progress(m["total_size"], "unpacking", quiet) as bar:
            for entry, piece in _stream(src, m, bar):  # checked again: the parts may change between passes
                if out is None:
                    path = dest / entry["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    out = open(path, "wb")
                if piece is None:
                    out.close()
                    out = None
                else:
                    out.write(piece)
    finally:
        if out is not None:
            out.close()


def _dequantized(m: dict, files: Path, dest: Path) -> None:
    """A GGUF pack's model directory in ``dest``: the weights dequantized here, checked against the
    packing machine's fingerprint, with the pack's other files (config, tokenizer) as they were."""
    from . import lm

    dest.mkdir()
    lm.dequantize_gguf(files / m["gguf"], dest)
    for e in m["files"]:
        if e["path"] != m["gguf"]:
            (dest / e["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files / e["path"], dest / e["path"])
    if weights_fingerprint(dest) != m["weights_fingerprint"]:
        import transformers

        raise PackError(f"the weights dequantized here (transformers {transformers.__version__}) differ from the "
                        f"packing machine's (hiso {m['hiso_version']}): pack the model without --gguf")


def unpack(src: str | Path, to: str | Path | None = None, quiet: bool = False) -> tuple[Path, bool]:
    """Check the pack in ``src``, then write its model directory to ``to`` (default: the model
    cache's entry for its name) atomically. Returns (target, whether it was written: False when
    an identical copy was already there)."""
    import importlib.util

    src = Path(src)
    m = verify(src, quiet)
    if m.get("gguf") and any(importlib.util.find_spec(p) is None for p in ("gguf", "transformers", "safetensors")):
        raise PackError("this pack holds a GGUF file: unpacking it needs transformers, safetensors and gguf here "
                        "(pip install gguf), or a pack made without --gguf")
    target = Path(to).expanduser() if to is not None else default_target(m)
    if target.exists():
        if target.is_dir() and _same_files(target, m):
            return target, False
        raise PackError(f"{target} already exists and differs from the pack (remove it, or unpack with --to DIR)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-unpack-", dir=target.parent))
    try:
        if m.get("gguf"):
            reassemble(src, m, tmp / "pack", quiet)
            _dequantized(m, tmp / "pack", tmp / "model")
            os.replace(tmp / "model", target)
        else:
            reassemble(src, m, tmp / "model", quiet)
            os.replace(tmp / "model", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def add_cache_parser(sub, parser_class) -> None:
    """``hiso cache pack`` and ``hiso cache unpack`` (see the module docstring)."""
    cache = sub.add_parser("cache", help="move a cached model to a machine without the internet: pack it into "
                           "checksummed parts, unpack them there into the model cache")
    verbs = cache.add_subparsers(dest="cache_command", required=True, parser_class=parser_class)
    pk = verbs.add_parser("pack", help="write a model's directory as parts of at most --part-size plus manifest.json")
    pk.add_argument("--model", required=True, help="a short name (its dequantized cache, built first if missing: "
                    "smollm2-135m, gemma3-270m) or a local model directory")
    pk.add_argument("--out", required=True, help="directory for the parts and manifest.json (new or empty)")
    pk.add_argument("--part-size", default=DEFAULT_PART_SIZE,
                    help=f"largest part, e.g. 60M, 1G (K/M/G = 1024^1,2,3 bytes; default {DEFAULT_PART_SIZE})")
    pk.add_argument("--gguf", action="store_true", help="pack the short name's GGUF file instead of its float32 "
                    "weights (4-5x smaller); unpacking dequantizes it (needs the gguf package there) and checks the "
                    "weights' fingerprint against this machine's")
    pk.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    up = verbs.add_parser("unpack", help="check every checksum of a pack, then write its model into the model cache")
    up.add_argument("dir", help="the pack's directory (its parts and manifest.json, nothing else)")
    up.add_argument("--to", help="write the model directory here instead of the model cache "
                    "(then pass this path as --model)")
    up.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def cmd_cache(args) -> int:
    try:
        return _cmd_cache(args)
    except OSError as e:  # a full disk, a directory that cannot be written: one line, not a traceback
        raise PackError(f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None


def _cmd_cache(args) -> int:
    if args.cache_command == "pack":
        size = parse_size(args.part_size)
        m = pack(args.model, args.out, size, quiet=args.quiet, gguf=args.gguf)
        print(f"packed {m['model']} ({len(m['files'])} files, {m['total_size']:,} bytes) into "
              f"{len(m['parts'])} parts of at most {size:,} bytes in {args.out}/; there: hiso cache unpack DIR")
        return 0
    target, written = unpack(args.dir, args.to, quiet=args.quiet)
    from .lm import SHORT_NAMES

    use = target.name if args.to is None and target.name in SHORT_NAMES else str(target)
    print(f"{'unpacked' if written else 'already unpacked (identical)'}: {target}; use --model {use}")
    return 0
