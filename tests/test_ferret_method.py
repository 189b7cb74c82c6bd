"""Ferret, sketch and FedKRSO are methods on the contract: their options (ferret_k, ferret_blocks,
sketch_bits) are their classes' fields (flags, TOML keys, --method-opt and a [method] table alike),
and older runs' flat options, configuration hash and fingerprint still read."""

import dataclasses
import json

import pytest

from cli_helpers import run_cli
import hiso.methods
from hiso import compat
from hiso.config import RunConfig, load_config
from hiso.core.join import config_blob
from hiso.core.method import Method
from hiso.methods.fedkrso import FedKRSO
from hiso.methods.ferret import Ferret
from hiso.methods.options import fields_of
from hiso.methods.registry import method_info
from hiso.methods.sketch import Sketch
from hiso.runners.runmodel import config_sha256
from legacy_helpers import dumped_flat, flat_config_hash

MOVED = ("ferret_k", "ferret_blocks", "sketch_bits")
TINY = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "3", "--quiet"]
CLASSES = {"ferret": Ferret, "sketch": Sketch, "fedkrso": FedKRSO}


@pytest.mark.parametrize("name", list(CLASSES))
def test_each_is_one_method_class_whose_fields_are_its_options(name):
    cls = CLASSES[name]
    info = method_info(name)
    assert issubclass(cls, Method) and info.cls is cls and getattr(hiso.methods, cls.__name__) is cls
    own = ("ferret_k", "ferret_blocks", "server_lr", *(("sketch_bits",) if cls is Sketch else ()))
    assert tuple(fields_of(cls)) == own  # the run's steps and clip are not options; its server step is
    assert not set(MOVED) & set(RunConfig.model_fields)
    # the registry's facts are the class's
    assert (info.gradient, info.server_lr, info.can, info.display) == ("first-order", 1.0, cls.can, cls.display)
    cfg = load_config(None, algorithm=name, ferret_k=3, ferret_blocks=2, local_steps=2, grad_clip=0.5)
    zo = cfg.zo()
    assert type(zo.method) is cls and zo.shape == (2, 3)
    assert (zo.method.steps, zo.method.server_lr, zo.method.resolved_server_lr, zo.method.grad_clip) == \
        (2, None, 1.0, 0.5)
    assert cfg.method_opts == {f: getattr(zo.method, f) for f in own}


@pytest.mark.parametrize("algorithm", ["sketch", "ferret"])
def test_flag_method_opt_toml_key_and_method_table_run_the_same_bits(tmp_path, capsys, algorithm):
    opts = {"ferret_k": 3, "ferret_blocks": 2} | ({"sketch_bits": 2} if algorithm == "sketch" else {})
    toml_flat, toml_table = tmp_path / "flat.toml", tmp_path / "table.toml"
    toml_flat.write_text("".join(f"{k} = {v}\n" for k, v in opts.items()))
    toml_table.write_text("[method]\n" + "".join(f"{k} = {v}\n" for k, v in opts.items()))
    ways = {"flags": [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))],
            "method-opt": [a for k, v in opts.items() for a in ("--method-opt", f"{k}={v}")],
            "toml": ["--config", str(toml_flat)], "table": ["--config", str(toml_table)], "default": []}
    for name, args in ways.items():
        code, _, err = run_cli(["run", "--out", str(tmp_path / name), *TINY, "--algorithm", algorithm, *args], capsys)
        assert code == 0, err
    files = {name: [(tmp_path / name / f).read_bytes() for f in ("history.bin", "model.pt")] for name in ways}
    assert all(files[name] == files["flags"] for name in ways if name != "default")
    assert files["default"][0] != files["flags"][0]  # the options did act
    saved = json.loads((tmp_path / "method-opt" / "config.json").read_text())
    assert saved["schema"] == compat.SCHEMA and not set(MOVED) & set(saved)
    assert saved["method_opts"] == {**opts, "server_lr": None}  # (the server step not given: the class's)


def _schema3(cfg: RunConfig) -> dict:
    """``cfg`` as hiso wrote it at schema 3: HiSo's options in method_opts, the other methods' of
    compat.FLAT_OPTIONS (Ferret's, sketch's, FedKRSO's, ...) flat in every run, at their defaults
    but in the run's method's."""
    values = dumped_flat(cfg)  # the task options flat too, as then
    opts = dict(values.pop("method_opts"))
    own = compat.FLAT_OPTIONS.get(cfg.algorithm, {})
    flat = {k: opts.pop(k) if k in own else d for k, d in compat.FLAT_DEFAULTS.items()
            if k not in compat.FLAT_OPTIONS["hiso"]}
    return {"schema": 3, **values, **flat, "method_opts": opts}


@pytest.mark.parametrize("kw", [dict(algorithm="ferret", ferret_k=4, ferret_blocks=3),
                                dict(algorithm="sketch", ferret_k=6, sketch_bits=4, grad_clip=1.0),
                                dict(algorithm="fedkrso"), dict(algorithm="hiso", nu=0.2), dict(algorithm="fedavg")])
def test_a_schema_3_configuration_with_the_flat_keys_reads_as_today_with_the_same_hash(kw):
    cfg = load_config(None, **kw)
    old = _schema3(cfg)
    raw, _ = compat.migrate(old)
    assert RunConfig(**raw).model_dump() == cfg.model_dump() and not set(MOVED) & set(raw)
    # the hash is the one the flat configuration had: every method's options flat (HiSo's too, as
    # before schema 3), method_opts {} left out, a later field left out at its default
    flat = {k: v for k, v in old.items() if k != "schema"}
    opts = dict(flat.pop("method_opts"))
    own = compat.FLAT_OPTIONS.get(cfg.algorithm, {})
    flat.update({k: opts.pop(k) if k in own else d for k, d in compat.FLAT_OPTIONS["hiso"].items()})
    if opts:
        flat["method_opts"] = opts
    assert config_sha256(cfg) == flat_config_hash(flat)


def test_the_fingerprint_keeps_the_old_class_and_field_names():
    ferret = json.loads(config_blob(load_config(None, algorithm="ferret", ferret_k=3, ferret_blocks=2).zo()))
    assert ferret["ferret"] == {"steps": 1, "server_lr": 1.0, "blocks": 2} and ferret["perturbations"] == 3
    sketch = json.loads(config_blob(load_config(None, algorithm="sketch", ferret_blocks=5, sketch_bits=4,
                                                grad_clip=0.5).zo()))
    assert sketch["method"] == {"class": "hiso.methods.sketch.SketchConfig", "steps": 1, "server_lr": 1.0,
                                "blocks": 5, "grad_clip": 0.5, "bits": 4} and sketch["ferret"] is None
    krso = json.loads(config_blob(load_config(None, algorithm="fedkrso").zo()))
    assert krso["method"] == {"class": "hiso.methods.fedkrso.FedKRSOConfig", "steps": 1, "server_lr": 1.0,
                              "blocks": 8, "grad_clip": None}


def test_a_moved_option_given_to_another_method_is_named_and_not_kept(tmp_path, capsys):
    for algorithm, flag, value, whose in (("decomfl", "--ferret-k", "9", "ferret's, sketch's and fedkrso's"),
                                          ("ferret", "--sketch-bits", "2", "sketch's")):
        out = tmp_path / algorithm
        code, _, err = run_cli(["run", "--out", str(out), *TINY, "--algorithm", algorithm, flag, value], capsys)
        name = flag[2:].replace("-", "_")
        assert code == 0 and f"{algorithm} does not use {name} ({whose})" in err, err
        saved = json.loads((out / "config.json").read_text())
        assert name not in saved and name not in saved["method_opts"]
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *TINY, "--algorithm", "ferret",
                            "--method-opt", "sketch_bits=2"], capsys)
    assert code == 2 and "ferret has no such option" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, needle", [
    (["--algorithm", "ferret", "--ferret-k", "300", "--ferret-blocks", "300"], "more than the format allows"),
    (["--algorithm", "sketch", "--sketch-bits", "3"], "sketch_bits must be one of 1, 2, 4, 8"),
    (["--algorithm", "fedkrso", "--method-opt", "ferret_blocks=0"], "ferret_blocks >= 1"),
    (["--algorithm", "ferret", "--method-opt", "steps=2"], "ferret has no such option"),
])
def test_the_class_checks_its_own_options_in_one_line(tmp_path, capsys, args, needle):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *TINY, *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_a_method_given_as_an_instance_runs_as_the_built_in_with_its_options():
    from hiso.methods.options import method_spec
    spec, opts = method_spec(Sketch(ferret_k=5, sketch_bits=2, steps=3))
    assert opts == {"ferret_k": 5, "sketch_bits": 2}  # steps is the run's (local_steps), not an option
    assert dataclasses.replace(Sketch(), **opts).bits == 2


def test_resume_refuses_another_value_of_a_method_flag_naming_both(tmp_path, capsys):
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--out", str(out), *TINY, "--algorithm", "ferret", "--ferret-k", "4"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["run", "--resume", str(out), "--ferret-k", "5", "--quiet"], capsys)
    assert code == 2 and "ferret_k = 5 would change its 4" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(["run", "--resume", str(out), "--ferret-k", "4", "--rounds", "4", "--quiet"], capsys)
    assert code == 0, err
