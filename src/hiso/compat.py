"""Reading what older versions of hiso wrote: config.json's schema version and the ledgers of
options, defaults and fingerprint fields added or changed since, in one place.

A run directory is read as it ran: :func:`migrate` turns an older ``config.json`` into today's
(the options it predates at the values its run was made with, task defaults it took that have
changed since at their old values), so rebuild, resume and export give what the run gave. The
tables below are the only record of what changed; a change that would make an old run read
differently adds a row here (and a fixture in tests/fixtures/legacy). No hiso imports: every
layer may read these tables.
"""

from __future__ import annotations

SCHEMA = 5  # config.json's "schema"; a file without one was written before schema versions (1); 3: a
# built-in method's options in its method_opts (FLAT_OPTIONS), paths relative to the run directory
# (hiso.runners.portable); 4: more built-in methods' options there (FLAT_OPTIONS: FedKSeed's,
# Ferret's, the sketch's and FedKRSO's); 5: the built-in tasks' options in task_opts (TASK_FLAT_OPTIONS)

# a built-in method's options that were flat RunConfig fields before schema 3 (HiSo's) or 4 (the
# others': every run's config.json had them, at these defaults unless given) and are its Method
# class's fields since, recorded in method_opts: algorithm -> {option: the default it had}.
# Reading an older file moves them into that method's method_opts and drops them from the other
# methods' (they did nothing there); the configuration's hash puts them back where they were
# (flat_options). Methods may share an option (Ferret's ferret_k is the sketch's and FedKRSO's too).
# Schema 5: the full-model baselines' options and the server step, Ferret's family's too (server_lr
# None: the method's default, as the flat field's None was).
_SERVER_LR = {"server_lr": None}
_FULL = {**_SERVER_LR, "wire_dtype": "float32"}
_ADAPTIVE = {**_SERVER_LR, "beta1": 0.9, "beta2": 0.99, "server_tau": 1e-3, "wire_dtype": "float32"}
_FERRET = {"ferret_k": 200, "ferret_blocks": 8, **_SERVER_LR}
FLAT_OPTIONS = {"hiso": {"nu": 0.05, "eps": 1e-8, "h_min": None, "h_max": None, "h_source": "last",
                         "h_stat": "ghat2", "h_granularity": "coordinate", "h_bias_correction": False},
                "fedkseed": {"seed_pool": 4096, "seed_sampling": "weighted"},
                "ferret": _FERRET, "sketch": {**_FERRET, "sketch_bits": 1}, "fedkrso": _FERRET,
                "fedzo": _FULL, "fedavg": _FULL, "fedadam": _ADAPTIVE, "fedyogi": _ADAPTIVE,
                "fedadagrad": {**_SERVER_LR, "server_tau": 1e-3, "wire_dtype": "float32"}}
FLAT_DEFAULTS = {name: default for owner in FLAT_OPTIONS.values() for name, default in owner.items()}

# the built-in tasks' options that were flat RunConfig fields before schema 5 (every run's
# config.json had them, at these defaults unless given) and are task options since
# (hiso.tasks.options), recorded in task_opts: option -> the default it had. Reading an older file
# moves them into task_opts; the configuration's hash puts them back flat (flat_options).
TASK_FLAT_OPTIONS = {"dim": 1000, "sigma": 1.0, "heterogeneity": 1.0, "noise": 0.0,
                     "data_dir": None, "partition": None, "alpha": 1.0, "min_size": 10, "eval_max": None,
                     "val_fraction": 0.0, "train_max": None,
                     "model": "smollm2-135m", "max_length": None, "template": None, "label_words": None,
                     "lora_r": None, "lora_alpha": 16.0, "lora_targets": "q_proj,v_proj", "base_dtype": "float32",
                     "quantize_embedding": True, "autocast": "auto", "eval_batch_size": 16, "max_new_tokens": 16,
                     "pack_sequences": True, "strip_text": True,
                     "text_column": "text", "label_column": "label", "prompt_column": "prompt",
                     "response_column": "response"}

# options added later whose default computes differently: option -> (the tasks it applies to, None
# for every task; the value runs made before it had). A config.json without `directions` predates
# the option, when torch-normal was the only family, so its run is rebuilt with that family.
# A config.json without `quantize_embedding` held an int8 or int4 base's embedding and head float32.
LANGUAGE = {"sst2", "qqp", "squad", "text", "instruct"}
MADE_BEFORE = {"pack_sequences": ({"sst2", "qqp", "squad"}, False), "directions": (None, "torch-normal"),
               "strip_text": ({"sst2", "qqp", "squad"}, False), "quantize_embedding": (LANGUAGE, False)}

# task defaults changed since: task -> (option, its default before), for runs that took the default
# (None in config.json) when it was the old value (task_info records the value used).
# squad's max_length is 640 since 2026-11-25: 256 cut the answer out of 4 % of contexts.
DEFAULT_BEFORE = {"squad": ("max_length", 256)}

# RunConfig fields added after exports began to carry the configuration's hash
# (runners.runmodel.config_sha256): at their default (FLAT_DEFAULTS' for an option flat then) they
# are left out, so older runs keep theirs
HASH_LATER_FIELDS = ("sketch_bits", "secagg_shares", "grad_clip", "method_opts",
                     "text_column", "label_column", "prompt_column", "response_column", "base_dtype")

# RunConfig fields that count in the configuration's hash only where they change what a run computes
# from what hiso computed before them (field -> that test on the configuration's values): a run that
# reads as made before them (MADE_BEFORE), or where they do nothing, keeps the hash it had
HASH_ONLY_WHERE = {"quantize_embedding": lambda v: v.get("quantize_embedding") is True
                   and v.get("base_dtype") in ("int8", "int4")}

# a built-in method's place in the protocol fingerprint hiso wrote before methods were plugins
# (core.join.config_blob): Ferret's fields under "ferret", FeedSign's as `signs: true`, HiSo's as
# its H's configuration under "precond" (it was ZOConfig.precond, which every blob has) and
# DeComFL's and FedKSeed's as nothing (they were no method); any other method's class and fields go
# under "method"
FINGERPRINT_LEGACY_KEY = {"hiso.methods.ferret.Ferret": "ferret", "hiso.methods.feedsign.FeedSign": "signs",
                          "hiso.methods.hiso_method.HiSo": "precond", "hiso.methods.decomfl.DeComFL": None,
                          "hiso.methods.fedkseed_method.FedKSeed": None}

# method classes renamed or reshaped since runs were written with them: class -> (the class the
# fingerprint names, {field: its name there, None: left out}). Ferret's, sketch's and FedKRSO's
# classes were FerretConfig, SketchConfig and FedKRSOConfig with fields blocks and bits; K, their
# ferret_k, was (and is) the record's P, which the fingerprint has already
_BLOCKS = {"ferret_k": None, "ferret_blocks": "blocks"}
FINGERPRINT_AS = {"hiso.methods.ferret.Ferret": ("hiso.methods.ferret.FerretConfig", _BLOCKS),
                  "hiso.methods.sketch.Sketch": ("hiso.methods.sketch.SketchConfig",
                                                 {**_BLOCKS, "sketch_bits": "bits"}),
                  "hiso.methods.fedkrso.FedKRSO": ("hiso.methods.fedkrso.FedKRSOConfig", _BLOCKS)}

# method fields added after runs were written with that method: left out of the fingerprint while
# None, so those runs' checkpoints and peers stay this configuration's
FINGERPRINT_LATER_FIELDS = {"hiso.methods.ferret.Ferret": ("grad_clip",),
                            "hiso.methods.sketch.Sketch": ("grad_clip",)}


def class_key(obj) -> str:
    """``module.QualName`` of an object's class: how the fingerprint tables name a method."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def fingerprint_method(method, fields: dict | None, uplink) -> dict:
    """The protocol fingerprint's entries for a method (``fields``: its dataclass fields;
    ``uplink``: its codec), as hiso wrote them before methods were plugins
    (:data:`FINGERPRINT_LEGACY_KEY`): ``signs`` (whether the answers are one-bit signs) and
    ``ferret`` in every blob, ``method`` for a method that table does not name (a class renamed
    or reshaped since by the names its runs' blobs have: :data:`FINGERPRINT_AS`)."""
    out = {"signs": getattr(uplink, "name", None) == "signs", "ferret": None}
    key = class_key(method)
    if fields is not None and "server_lr" in fields and fields["server_lr"] is None:
        # the server step was a run's value, resolved before the method was built (Ferret's 1.0)
        fields = {**fields, "server_lr": getattr(method, "default_server_lr", None)}
    named, renamed = FINGERPRINT_AS.get(key, (key, {}))
    if fields is not None:
        fields = {renamed.get(k, k): v for k, v in fields.items() if renamed.get(k, k) is not None}
    if method is not None and key not in FINGERPRINT_LEGACY_KEY:
        out["method"] = {"class": named, **(fields or {})}
    elif FINGERPRINT_LEGACY_KEY.get(key) == "ferret":
        out["ferret"] = fields
    return out


def predates(raw: dict) -> dict:
    """The options a saved configuration predates (:data:`MADE_BEFORE`), at the values its run was
    made with, and the task defaults it took that have changed since (:data:`DEFAULT_BEFORE`)."""
    task = raw.get("task", "quadratic")
    if not isinstance(task, str):  # (damaged: RunConfig refuses it)
        return {}
    opts = raw.get("task_opts")
    given = {**(opts if isinstance(opts, dict) else {}), **raw}  # (a task option in task_opts since schema 5)
    out = {k: v for k, (tasks, v) in MADE_BEFORE.items() if k not in given and (tasks is None or task in tasks)}
    if task in DEFAULT_BEFORE:
        name, old = DEFAULT_BEFORE[task]
        if given.get(name) is None and (raw.get("task_info") or {}).get(name) == old:
            out[name] = old
    return out


def migrate(raw: dict) -> tuple[dict, dict]:
    """An older config.json's object as today's: (the object without its schema key, the options it
    predates at their old values, :func:`predates`). ValueError for a schema newer than this hiso's."""
    raw = dict(raw)
    schema = raw.pop("schema", 1)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ValueError(f"schema {schema!r} is not a config.json schema version")
    if schema > SCHEMA:
        raise ValueError(f"written by a newer hiso (config.json schema {schema}, this hiso reads up to {SCHEMA}): "
                         "upgrade hiso to read it")
    if schema < 5:  # methods' flat options into method_opts, tasks' into task_opts
        raw = nest_task_options(unflatten(raw))
    return raw, predates(raw)


def nest_task_options(raw: dict) -> dict:
    """A schema 1 to 4 configuration with the task options of :data:`TASK_FLAT_OPTIONS` in its
    ``task_opts`` (RunConfig drops those its task does not read, at their defaults)."""
    flat = {k: raw[k] for k in TASK_FLAT_OPTIONS if k in raw}
    if not flat:
        return raw
    opts = raw.get("task_opts")
    return {**{k: v for k, v in raw.items() if k not in flat},
            "task_opts": {**flat, **(opts if isinstance(opts, dict) else {})}}


def unflatten(raw: dict) -> dict:
    """A schema 1 to 4 configuration with its methods' flat options (:data:`FLAT_OPTIONS`) in the
    ``method_opts`` of the method they belong to, and dropped from any other's."""
    raw = dict(raw)
    flat = {k: raw.pop(k) for owner in FLAT_OPTIONS.values() for k in owner if k in raw}
    own = FLAT_OPTIONS.get(raw.get("algorithm", "hiso")) if isinstance(raw.get("algorithm", "hiso"), str) else None
    if own and flat:
        opts = raw.get("method_opts")
        raw["method_opts"] = {**{k: v for k, v in flat.items() if k in own}, **(opts if isinstance(opts, dict) else {})}
    return raw


def flat_options(values: dict) -> dict:
    """A configuration's values (``RunConfig.model_dump()``) as before schema 3, for its hash: the
    options of :data:`FLAT_OPTIONS` flat again, at their defaults where the method has none, and
    those of :data:`TASK_FLAT_OPTIONS` (``task_opts``, gone) at their defaults where the task has none."""
    values = {**dict(values), **FLAT_DEFAULTS}
    opts = dict(values.get("method_opts") or {})
    for name in FLAT_OPTIONS.get(values.get("algorithm"), {}):
        values[name] = opts.pop(name, FLAT_DEFAULTS[name])
    values["method_opts"] = opts
    return flat_task_options(values)


def flat_task_options(values: dict) -> dict:
    """A configuration's values with its ``task_opts`` flat again, as before schema 5: each option of
    :data:`TASK_FLAT_OPTIONS` at its value, or its default where the task has none."""
    values = dict(values)
    task = values.pop("task_opts", None)
    return {**TASK_FLAT_OPTIONS, **values, **(task if isinstance(task, dict) else {})}
