"""A run's configuration: one validated record (TOML file < command-line flags).

Flat on purpose (like nanoGPT's config): every knob is one name, the same in the TOML file and
on the command line (``--local-steps`` for ``local_steps``); in ``config.json`` a method's own
options sit in ``method_opts`` and the task's in ``task_opts`` (their classes' fields).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic.fields import FieldInfo

from .config_methods import MethodRules
from .config_tasks import TaskRules
from .config_parse import ConfigError, read_toml  # noqa: F401  (hiso.config.ConfigError, read_toml)
from .config_parse import kind as _kind, nearest, parse_every, parse_size  # noqa: F401  (hiso.config.parse_*)
from .core.config import ZOConfig
from .methods.momentum import MomentumConfig
from .methods.privacy import DPConfig
from .methods.registry import method_names
from .methods.stepnorm import StepNormConfig
from .tasks.registry import algorithm_family  # noqa: F401  (hiso.config.algorithm_family)

ALGORITHMS = method_names()  # the built-in methods (hiso.methods.registry); a user's is module:Class


def default_lr(task: str, algorithm: str, lora: bool = False, model: str | None = None) -> float:
    """The lr a run of ``algorithm`` on ``task`` (with ``model``) gets when none is given: the
    task's own ``default_lr`` table, registered with the task (:mod:`hiso.tasks.registry`)."""
    from .tasks.registry import default_lr as lookup
    return lookup(task, algorithm, lora, model)


def task_names() -> tuple[str, ...]:
    """The built-in tasks' names (a user's task is ``module:Class`` or ``path/to/file.py:Class``)."""
    from .tasks.registry import builtin_names
    return builtin_names()


class RunConfig(TaskRules, BaseModel, MethodRules):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf or nan in any number: refused
    _lr_defaulted: bool = PrivateAttr(False)  # lr is the task's default, not given
    _unused_flags: dict = PrivateAttr(default_factory=dict)  # flags of another method's (nu on decomfl): not kept

    task: str = Field("quadratic", description=(
        "the problem: model, data and metric; a built-in name, or your own Task subclass as module:Class or "
        "path/to/file.py:Class"))
    algorithm: str = Field("hiso", description=(
        "the federated algorithm (hiso, decomfl: seeds and scalars on the wire; feedsign: seeds and one sign bit "
        "per client-step, majority vote (P = 1, central differences by default); fedkseed: a fixed pool of seed_pool "
        "seeds, (index, scalar) pairs on the wire; ferret: first-order local steps, K projections per block on "
        "the wire; sketch: ferret's projections as b-bit codes; fedkrso: first-order local steps inside K seeded "
        "directions per block, their K coefficients on the wire; greedy: the best of P candidate directions a "
        "step as (index, scalar); conmezo: directions in a cone around a replicated momentum, P scalars; the "
        "others send the model); or your own hiso.core.method.Method subclass as module:Class or "
        "path/to/file.py:Class"))
    method_opts: dict[str, Any] = Field(default_factory=dict, description=(
        "the method's own options, the fields of its Method subclass (yours, or hiso's nu and h_*, conmezo's "
        "theta and beta): --method-opt KEY=VALUE (repeatable), a [method] table in TOML; the built-ins' "
        "(hiso's, fedkseed's, ferret's, sketch's, fedkrso's, the full-model baselines') are also flags (--nu, "
        "--seed-pool, --ferret-k, --server-lr) and TOML keys (nu = ...)"))
    task_opts: dict[str, Any] = Field(default_factory=dict, description=(
        "the task's own options, the fields of its options class (hiso.tasks.options: the quadratic's dim, "
        "sigma, ...; the data's data_dir, partition, ...; the language model's model, lora_r, ...; the text and "
        "instruct tasks' columns), read as cfg.task_options; each is also a flag (--dim) and a TOML key "
        "(dim = ...), and a [task_opts] table in TOML sets them too"))
    rounds: int = Field(300, gt=0, description="communication rounds")
    clients: int = Field(20, gt=0, description="clients in the federation (M)")
    sampled: int = Field(4, gt=0, description="clients sampled per round (m <= clients)")
    local_steps: int = Field(1, gt=0, description="local steps a sampled client takes per round (tau)")
    perturbations: int = Field(5, gt=0, description="random directions per ZO gradient estimate (P)")
    lr: float | None = Field(None, gt=0, description=(
        "client learning rate (default: per task and algorithm (each task's default_lr, see hiso.tasks.registry); "
        "config.json records the value used)"))
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
        "direction family: how a seed becomes a random direction: philox-rademacher (default: random signs) or "
        "philox-gaussian (a Gaussian by table lookup), both Philox4x32-10 with the same bits on every device and "
        "torch version and fused kernels; or torch-normal (the paper's Gaussian from torch's CPU stream: slower, "
        "peers need the same torch version); sparse or lowrank (structured, see hiso.core.families)"))
    direction_density: float | None = Field(None, gt=0, le=1, description=(
        "directions sparse: the share q of coordinates each direction perturbs, scaled by 1/sqrt(q) (default: 0.1)"))
    direction_rank: int | None = Field(None, gt=0, description=(
        "directions lowrank: the rank r of each weight matrix's direction U V^T / sqrt(r) (default: 1)"))
    direction_refresh: int | None = Field(None, gt=0, description=(
        "directions lowrank: keep V for this many rounds (LOZO), U fresh each step; V from the run seed and "
        "round // k (default: V fresh each step)"))
    direction_mask: Literal["magnitude"] | None = Field(None, description=(
        "directions sparse: perturb a fixed mask, each tensor's direction_density share of largest |x_0|, "
        "chosen at round 0 from the initial model (default: a fresh random subset per direction)"))
    scalar_dtype: Literal["float32", "float16", "bfloat16", "int8", "int4", "int2", "sign"] = Field(
        "float32", description=(
            "number format of the ZO scalars, both directions and in history.bin (hiso, decomfl, conmezo, greedy; 2 bytes for "
            "float16/bfloat16; int8: one byte a scalar plus a float32 scale per message and per history record; "
            "int4, int2 (ternary), sign (1 bit, the scaled sign): that many bits a scalar plus a float32 scale per "
            "message and per record (hiso, decomfl: more perturbations per byte; sketch: its downlink))"))
    snapshot_after: int | None = Field(None, ge=0, description=(
        "send a client that missed more than this many rounds the server's model (and H) instead of the history "
        "(default: automatic, when the snapshot is fewer bytes, or with --bandwidth faster)"))
    bandwidth: float | None = Field(None, gt=0, description=(
        "a client's downlink in bytes/s, for the automatic snapshot choice: snapshot when sending it is faster "
        "than sending and replaying the history (default: compare bytes only)"))
    weighted: bool = Field(False, description="weight clients' contributions by their data size (default: plain mean)")
    mode: Literal["fast", "faithful"] = Field("fast", description=(
        "fast: one shared model copy; faithful: a model (and H) per client, rebuilt from its downlink bytes"))
    perturb_mode: Literal["hooks", "swap", "batched"] = Field("hooks", description=(
        "hooks: perturb each layer's parameters only while it runs (no copy); swap: shift the whole model (one "
        "extra copy); batched: a local step's P+1 points in one stacked forward (torch.func.vmap; one shifted "
        "copy of the trainable tensors per point, in chunks of --batch-memory)"))
    batch_memory: str | int | None = Field(None, description=(
        "batched perturb mode: bytes of stacked shifted tensors per forward, e.g. 512M or 4G (default: 2G); "
        "points beyond it run in further forwards"))
    momentum: float | None = Field(None, gt=0, lt=1, description=(
        "server-side momentum beta on the replayed global update, EMA form m = beta m + (1-beta) ghat (hiso, "
        "decomfl, greedy; default: none)"))
    lr_decay: float | None = Field(None, gt=0, description=(
        "inverse-time lr decay over rounds: round r steps with lr / (1 + r / lr_decay), half of lr at round "
        "lr_decay (hiso, decomfl, feedsign, conmezo, greedy; ferret and sketch: their clients' SGD lr; default: "
        "constant lr)"))
    grad_clip: float | None = Field(None, gt=0, description=(
        "clip each local SGD step's gradient to this L2 norm over the trainable tensors, as torch's "
        "clip_grad_norm_ (ferret, sketch; default: not clipped)"))
    # client-level differential privacy of the scalars (hiso, decomfl; see hiso.methods.privacy)
    dp_clip: float | None = Field(None, gt=0, description=(
        "differential privacy: clip each client's scalars of a round to this L2 norm (turns DP on; default: off)"))
    dp_noise_multiplier: float | None = Field(None, ge=0, description=(
        "DP: Gaussian noise std as a multiple of dp_clip, added to the sum of the clipped answers (central) or "
        "to each answer (local); or give dp_epsilon"))
    dp_epsilon: float | None = Field(None, gt=0, description=(
        "DP: the privacy budget: the noise multiplier is solved so that the run's rounds spend at most this "
        "epsilon at dp_delta, and a run extended past it stops"))
    dp_delta: float | None = Field(None, gt=0, lt=1, description="DP: the delta of (epsilon, delta)-DP reported and targeted")
    dp_mode: Literal["central", "local"] = Field("central", description=(
        "DP: central (the server clips and adds one noise draw to the sum) or local (each client clips and "
        "noises what it sends)"))
    dp_noise_seed: int | None = Field(None, ge=0, lt=2**63, description=(
        "DP: secret key of the noise (default: drawn at the run's start and kept in DIR/dp_secret.json, never "
        "sent); set it only for reproducible experiments"))
    # secure aggregation of the scalars (hiso, decomfl; hiso.methods.secagg, on Flower hiso.flower.secagg)
    secagg: bool = Field(False, description=(
        "secure aggregation (hiso, decomfl, plain mean): on Flower the server learns only the sum of a round's "
        "scalars (Flower's SecAgg+); each scalar is quantised to a grid (secagg_clip, secagg_bits) so the sum is "
        "exact, and hiso run applies the same quantisation (same model)"))
    secagg_clip: float | None = Field(None, gt=0, description=(
        "secagg: each scalar is clipped to [-c, c] before quantisation; a power of two (default: 256, or with "
        "central DP the power of two at or above dp_clip; config.json records the value used)"))
    secagg_bits: int = Field(24, ge=2, le=30, description=(
        "secagg: 2^bits grid levels over [-c, c]: a scalar moves by at most c / 2^bits"))
    secagg_modulus_bits: int = Field(32, le=62, description=(
        "secagg: masks and sums modulo 2^this; it must exceed secagg_bits + log2(sampled) so a round's sum fits"))
    secagg_threshold: int | None = Field(None, ge=2, description=(
        "secagg: shares that rebuild a dropped client's masks; a round closes while at least this many of its "
        "clients answer (default: a majority of sampled, at least 2, or of secagg_shares; config.json records the "
        "value used)"))
    secagg_shares: int | None = Field(None, ge=3, description=(
        "secagg on Flower: each client's secrets go to this many clients, itself included (SecAgg+'s num_shares, "
        "odd: its neighbours on a ring of the round's clients), not to all; a round then closes while every client "
        "has at least secagg_threshold (below this number) of them answering (default: all clients)"))
    step_norm: Literal["std"] | None = Field(None, description=(
        "std: divide the global step by a moving RMS of the round's aggregated scalars, from the log alone "
        "(hiso.methods.stepnorm; hiso, decomfl, local_steps 1; default: none)"))
    step_norm_beta: float = Field(0.9, ge=0, lt=1, description=(
        "step_norm: weight of the old value in the moving average of the scalars' mean square (0: this round's)"))
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: torch's own)")
    checkpoint_every: str | int = Field("5m", description=(
        "write the server's state (model, H) to DIR/checkpoint.pt every this many rounds (an integer) or this much "
        "training time (90s, 5m, 1h; 0: never), so --resume replays only the rounds after it instead of the whole "
        "log (hiso, decomfl, feedsign, ferret); changes no result, and may differ when a run is resumed"))
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description=(
        "where clients and the server run their model: cpu, or cuda / cuda:N (directions of the Philox families "
        "are then generated on the GPU; hiso rebuild replays on the CPU)"))
    # reliability (hiso, decomfl, feedsign, ferret): how the server combines answers, simulated faults and attackers
    aggregate: Literal["mean", "median", "trimmed-mean"] = Field("mean", description=(
        "how the server combines the clients' scalars, per (step, perturbation) entry: (weighted) mean, weighted "
        "median, or trimmed mean (see hiso.core.aggregate)"))
    trim: float = Field(0.25, ge=0, lt=0.5, description=(
        "trimmed-mean: fraction of answers dropped at each end, per entry (floor(trim x answers))"))
    drop_rate: float = Field(0.0, ge=0, le=1, description=(
        "simulator: probability that a client's answer is lost (the client computed it)"))
    late_rate: float = Field(0.0, ge=0, le=1, description=(
        "simulator: probability that an answer arrives after its round closed (rejected as wrong-round)"))
    duplicate_rate: float = Field(0.0, ge=0, le=1, description="simulator: probability that an answer is sent twice")
    corrupt_rate: float = Field(0.0, ge=0, le=1, description=(
        "simulator: probability that an answer's bytes are damaged in transit (1-3 bits flipped)"))
    byzantine: int = Field(0, ge=0, description=(
        "simulator: number of Byzantine clients (drawn from the seed; listed in summary.json)"))
    byzantine_per_round: bool = Field(False, description=(
        "simulator: the Byzantine clients are K of each round's sampled clients, drawn per round (exactly K per "
        "round), instead of K fixed clients"))
    attack: str = Field("scale", description=(
        "what Byzantine clients send: scale, sign-flip, random or nan; a comma list is given to them in turn"))
    attack_scale: float = Field(1e3, gt=0, description=(
        "Byzantine 'scale': factor on the scalars; 'random': noise std relative to the honest scalars' RMS"))
    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        from .tasks.registry import absolute_task_name, task_info
        if (name := absolute_task_name(self.algorithm)) != self.algorithm:  # a user's method, from anywhere later
            self.algorithm = name
        self.method  # (asked first) an unknown method, or a user's that cannot be imported: one line
        self._method_opts_checks()
        self._base_dtype_checks()
        if (name := absolute_task_name(self.task)) != self.task:  # path/to/file.py:Class, read from anywhere later
            self.task = name
        task = task_info(self.task)  # an unknown task, or a user's task that cannot be imported: one line
        self._task_option_checks(task)
        self._task_opts_checks(task)
        opts = self.task_options
        if opts.val_fraction > 0 and not task.validation:
            raise ValueError(f"task {self.task} has no validation split: val_fraction must be 0")
        if self.sampled > self.clients:
            raise ValueError(f"sampled ({self.sampled}) cannot exceed clients ({self.clients})")
        from .core.directions import FAMILIES
        if self.directions not in FAMILIES:
            raise ValueError(f"unknown direction family {self.directions!r} (choose from {', '.join(FAMILIES)})")
        faults = self.drop_rate + self.late_rate + self.duplicate_rate + self.corrupt_rate
        if faults >= 1:
            raise ValueError(f"drop, late, duplicate and corrupt rates sum to {faults:g}: they must be < 1")
        if self.byzantine > (self.sampled if self.byzantine_per_round else self.clients):
            raise ValueError(f"byzantine ({self.byzantine}) cannot exceed "
                             + (f"sampled ({self.sampled})" if self.byzantine_per_round
                                else f"clients ({self.clients})"))
        self._method_checks(faults)
        if self.batch_memory is not None:
            parse_size(self.batch_memory)
        parse_every(self.checkpoint_every)
        if self.direction_density is not None and self.directions != "sparse":
            raise ValueError("direction_density is for directions sparse")
        if self.direction_rank is not None and self.directions != "lowrank":
            raise ValueError("direction_rank is for directions lowrank")
        if self.direction_refresh is not None and self.directions != "lowrank":
            raise ValueError("direction_refresh is for directions lowrank")
        if self.direction_mask is not None and self.directions != "sparse":
            raise ValueError("direction_mask is for directions sparse")
        if self.lr is None:
            self.lr = default_lr(self.task, self.algorithm, lora=opts.lora_r is not None,
                                 model=opts.model if task.options is None or "model" in task.options else None)
            self._lr_defaulted = True  # (a RunConfig reused for another task takes that task's default)
        self._honour_checks()
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _method_flags(cls, values: Any, handler) -> "RunConfig":
        """A method's flags (``nu = 0.1``) become its ``method_opts``, another method's are kept
        apart for :meth:`unused_options` (:func:`hiso.config_parse.split_flags`). ``rounds = true``
        in a TOML file is a mistake, not 1 round: a number option refuses a bool (pydantic would)."""
        unused = {}
        if isinstance(values, dict):
            from .config_parse import route_task_options, split_flags
            from .tasks.options import option_fields as task_fields
            values, unused = split_flags(values)
            for name, value in values.items():
                field = cls.model_fields.get(name) or task_fields().get(name)
                if isinstance(value, bool) and field is not None and field.annotation is not bool:
                    raise ValueError(f"{name} = {str(value).lower()}: expected {_kind(field.annotation)}, not true/false")
            values = route_task_options(values, task_fields())
        self = handler(values)
        defaults = option_fields() if unused else {}
        self._unused_flags = {k: v for k, v in unused.items() if v != defaults[k].default}
        return self

    @property
    def batch_memory_bytes(self) -> int | None:
        """``batch_memory`` in bytes (None: the perturber's default)."""
        return None if self.batch_memory is None else parse_size(self.batch_memory)

    def zo(self) -> ZOConfig:
        method = self.method.build(self)  # the core's hooks and stages (HiSo's keeps H)
        shape = None if method is None else method.record_shape()
        if shape is not None:  # its own record (Ferret's (B, K)); its local steps live in the method
            return ZOConfig(lr=self.lr, mu=self.mu, perturbations=shape[1], local_steps=shape[0],
                            directions=self.directions, scalar_dtype=self.scalar_dtype, lr_decay=self.lr_decay,
                            method=method)
        momentum = None if self.momentum is None else MomentumConfig(beta=self.momentum)
        dp = None if self.dp_clip is None else DPConfig(self.dp_clip, self.dp_noise, self.dp_mode)
        step_norm = None if self.step_norm is None else StepNormConfig(self.step_norm, self.step_norm_beta)
        return ZOConfig(lr=self.lr, mu=self.mu, perturbations=self.perturbations,
                        local_steps=self.local_steps, difference=self.difference,
                        directions=self.direction_spec, scalar_dtype=self.scalar_dtype, momentum=momentum,
                        lr_decay=self.lr_decay, dp=dp, method=method, step_norm=step_norm)

    @property
    def direction_spec(self) -> str:
        """The direction family with its parameters (``sparse:q=0.1``): what history.bin's header
        and the join fingerprint record (a dense family's spec is its name)."""
        from .core.families import spec
        return spec(self.directions, self.direction_density, self.direction_rank, self.direction_refresh,
                    self.direction_mask)


# options that change how a run is carried out, never its results: a resumed run may take others
RUNTIME_ONLY = ("checkpoint_every",)

FLAGS_BEFORE = "momentum"  # where a method's own flags (nu, h_*) sit among the run's options (--help, docs), unless
# its class says (``flags_at``: Ferret's before step_norm, FedKSeed's before Ferret's ferret_k)


def option_fields() -> dict[str, FieldInfo]:
    """Every option of a run by its flag's and TOML key's name, in --help's order: RunConfig's
    fields and the built-in methods' own fields that are flags too (HiSo's ``nu``, Ferret's
    ``ferret_k``, ...: their ``method_opts`` when the run is theirs,
    :func:`hiso.methods.registry.flag_options`)."""
    import dataclasses

    from .methods.options import fields_of
    from .methods.registry import flag_options
    from .tasks.options import option_fields as task_fields
    flags: dict[str, dict[str, FieldInfo]] = {}  # by the option (RunConfig's or a flag) they sit before
    for name, (cls, _) in flag_options().items():
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        flags.setdefault(getattr(cls, "flags_at", FLAGS_BEFORE), {})[name] = FieldInfo(
            annotation=fields_of(cls)[name], default=f.default, description=f.metadata.get("help"))
    out: dict[str, FieldInfo] = {}

    def put(name: str, field: FieldInfo) -> None:
        for flag, info in flags.get(name, {}).items():
            put(flag, info)
        out[name] = field
    for name, field in RunConfig.model_fields.items():
        if name != "task_opts":  # (a flag per task option instead)
            put(name, field)
    return {**out, **task_fields()}  # the task's options (dim, ...: its task_opts), after the run's


def one_line(err: ValidationError, prefix: str | None = None) -> str:
    """A pydantic validation error as one line: ``where: what`` (``where`` under ``prefix``); an
    unknown option names the nearest known one."""
    e = err.errors()[0]
    where = ".".join(str(x) for x in (*([prefix] if prefix else []), *e["loc"]))
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden" and e["loc"]:
        msg = "not an option" + nearest(str(e["loc"][-1]), option_fields())
    return f"{where}: {msg}" if where else msg


def load_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    """Defaults, then the TOML file (if any), then non-None overrides; validated. A ``[compare]``
    table is ``hiso compare``'s and is left out, so a comparison's file also configures one run."""
    values = read_toml(path)
    if isinstance(values.get("compare"), dict):
        values.pop("compare")
    from .config_parse import merge_options
    try:
        values = merge_options(values, {k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return RunConfig(**values)
    except ValidationError as e:
        key = (e.errors()[0].get("loc") or ("",))[0]
        given = {k for k, v in overrides.items() if v is not None}
        raise ConfigError((f"{path}: " if path is not None and key not in given else "") + one_line(e)) from None
