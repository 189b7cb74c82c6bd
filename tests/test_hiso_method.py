"""HiSo is a method on the contract: its options are its class's fields (flags, TOML keys,
--method-opt and a [method] table alike), H is its stage, and older runs' flat options still read."""

import dataclasses
import json

import pytest

from cli_helpers import run_cli
from hiso import compat
from hiso.config import RunConfig, load_config
from hiso.core import ModelState
from hiso.core.chain import Precondition, stages_for
from hiso.core.join import config_blob
from hiso.core.method import Method
from hiso.runners.runmodel import config_sha256
from legacy_helpers import dumped_flat, flat_config_hash

H_OPTIONS = ("nu", "eps", "h_min", "h_max", "h_source", "h_stat", "h_granularity", "h_bias_correction")
TINY = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "4",
        "--local-steps", "2", "--quiet"]


def test_hiso_is_a_method_whose_fields_are_its_options_and_runconfig_has_none_of_them():
    import hiso.methods
    from hiso.methods.hiso_method import HiSo
    assert hiso.methods.HiSo is HiSo and issubclass(HiSo, Method)
    assert tuple(f.name for f in dataclasses.fields(HiSo)) == H_OPTIONS
    assert not set(H_OPTIONS) & set(RunConfig.model_fields)
    cfg = load_config(None, algorithm="hiso", nu=0.2)
    assert type(cfg.zo().method) is HiSo and cfg.zo().method.nu == 0.2
    assert cfg.method_opts == {**{f.name: f.default for f in dataclasses.fields(HiSo)}, "nu": 0.2}


def test_h_is_the_methods_stage_and_decomfl_has_none():
    hiso_zo, decomfl_zo = (load_config(None, algorithm=a, h_source="every").zo() for a in ("hiso", "decomfl"))
    first = stages_for(hiso_zo)[0]
    assert isinstance(first, Precondition) and first.cfg.source == "every" and hiso_zo.precond == first.cfg
    assert not any(isinstance(st, Precondition) for st in stages_for(decomfl_zo)) and decomfl_zo.precond is None
    from hiso.tasks.quadratic import QuadraticTask
    task = QuadraticTask(num_clients=2, dim=6, seed=0)
    assert list(ModelState(task.build_model(), hiso_zo).state_dict()) == ["round", "model", "h"]
    assert "h" not in ModelState(task.build_model(), decomfl_zo).state_dict()


def test_method_opt_flag_toml_key_and_method_table_run_the_same_bits(tmp_path, capsys):
    toml_flat, toml_table = tmp_path / "flat.toml", tmp_path / "table.toml"
    toml_flat.write_text('nu = 0.3\nh_min = 0.5\nh_source = "every"\n')
    toml_table.write_text('[method]\nnu = 0.3\nh_min = 0.5\nh_source = "every"\n')
    ways = {"flags": ["--nu", "0.3", "--h-min", "0.5", "--h-source", "every"],
            "method-opt": ["--method-opt", "nu=0.3", "--method-opt", "h_min=0.5", "--method-opt", "h_source=every"],
            "toml": ["--config", str(toml_flat)], "table": ["--config", str(toml_table)]}
    for name, args in ways.items():
        code, _, err = run_cli(["run", "--out", str(tmp_path / name), *TINY, *args], capsys)
        assert code == 0, err
    code, _, err = run_cli(["run", "--out", str(tmp_path / "default"), *TINY], capsys)
    assert code == 0, err
    files = {name: [(tmp_path / name / f).read_bytes() for f in ("history.bin", "model.pt")] for name in ways}
    assert all(files[name] == files["flags"] for name in ways)
    assert (tmp_path / "default" / "history.bin").read_bytes() != files["flags"][0]  # the options did act
    saved = json.loads((tmp_path / "method-opt" / "config.json").read_text())
    assert saved["schema"] == compat.SCHEMA and not set(H_OPTIONS) & set(saved)
    assert (saved["method_opts"]["nu"], saved["method_opts"]["h_min"], saved["method_opts"]["h_source"]) == (
        0.3, 0.5, "every")


def test_an_option_given_twice_or_out_of_range_is_one_line(tmp_path, capsys):
    for args, needle in ((["--nu", "0.2", "--method-opt", "nu=0.1"], "give it once"),
                         (["--method-opt", "nu=2"], "nu must be in [0, 1]"),
                         (["--h-min", "0"], "h_min must be > 0")):
        code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *TINY, *args], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert load_config(None, nu=0.2, method_opts={"nu": "0.2"}).method_opts["nu"] == 0.2  # the same value twice


def test_another_methods_flag_is_named_and_not_kept(tmp_path, capsys):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "d"), *TINY, "--algorithm", "decomfl", "--nu", "0.5"],
                           capsys)
    assert code == 0 and "decomfl does not use nu (HiSo's preconditioner)" in err and "does not record" in err
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "nu" not in saved and saved["method_opts"] == {}
    code, _, err = run_cli(["run", "--out", str(tmp_path / "c"), *TINY, "--algorithm", "decomfl",
                            "--method-opt", "nu=0.5"], capsys)
    assert code == 2 and "decomfl has no options of its own" in err


def _schema2(cfg: RunConfig) -> dict:
    """``cfg`` as hiso wrote it before schema 3: every run with the 8 options flat (and the other
    methods' flat options of compat.FLAT_OPTIONS, at their defaults but the run's method's)."""
    values = dumped_flat(cfg)  # the task options flat too, as then
    opts = dict(values.pop("method_opts"))
    own = compat.FLAT_OPTIONS.get(cfg.algorithm, {})
    flat = {k: opts.pop(k) if k in own else d for k, d in compat.FLAT_DEFAULTS.items()}
    return {"schema": 2, **values, **flat, "method_opts": opts}


@pytest.mark.parametrize("kw", [dict(algorithm="hiso"), dict(algorithm="hiso", nu=0.2, h_max=3.0, h_stat="floor"),
                                dict(algorithm="decomfl"), dict(algorithm="fedavg")])
def test_a_schema_2_configuration_reads_as_today_with_the_same_hash(kw):
    cfg = load_config(None, **kw)
    old = _schema2(cfg)
    raw, _ = compat.migrate(old)
    assert RunConfig(**raw).model_dump() == cfg.model_dump() and not set(H_OPTIONS) & set(raw)
    # the hash exports carry is the one the flat configuration had (method_opts {}: left out, as before)
    assert config_sha256(cfg) == flat_config_hash(old)


def test_hisos_fingerprint_blob_is_the_one_of_zoconfig_precond():
    blob = json.loads(config_blob(load_config(None, algorithm="hiso", nu=0.2, h_granularity="tensor").zo()))
    assert "method" not in blob and blob["signs"] is False and blob["ferret"] is None
    assert blob["precond"] == {"nu": 0.2, "eps": 1e-8, "h_min": None, "h_max": None, "source": "last",
                               "stat": "ghat2", "granularity": "tensor", "bias_correction": False}
    assert json.loads(config_blob(load_config(None, algorithm="decomfl").zo()))["precond"] is None


def test_the_python_api_takes_hisos_class_and_its_flags():
    import hiso
    from hiso.methods import HiSo
    cfg = hiso.run_config("quadratic", algorithm=HiSo(nu=0.1, h_source="every"))
    assert cfg.algorithm == "hiso" and (cfg.method_opts["nu"], cfg.method_opts["h_source"]) == (0.1, "every")
    assert hiso.run_config("quadratic", config=cfg, nu=0.3).method_opts["nu"] == 0.3  # a flag over the config's
