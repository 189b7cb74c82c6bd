"""The full-model baselines are method classes: their options (server_lr, beta1, beta2,
server_tau, wire_dtype) are their classes' fields (flags, TOML keys, --method-opt and a [method]
table alike), --server-lr still reaches Ferret's, and older runs' flat options and configuration
hash still read."""

import json

import pytest

from cli_helpers import run_cli
import hiso.methods
from hiso import compat
from hiso.config import RunConfig, load_config
from hiso.core.method import Method
from hiso.methods.fullmodel import FedAdagrad, FedAdam, FedAvg, FedYogi, FedZO
from hiso.methods.options import fields_of
from hiso.methods.registry import method_info
from hiso.runners.runmodel import config_sha256
from legacy_helpers import dumped_flat, flat_config_hash

MOVED = ("server_lr", "beta1", "beta2", "server_tau", "wire_dtype")
TINY = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "3", "--quiet"]
CLASSES = {"fedzo": (FedZO, 1.0, ("server_lr", "wire_dtype")), "fedavg": (FedAvg, 1.0, ("server_lr", "wire_dtype")),
           "fedadam": (FedAdam, 0.01, MOVED), "fedyogi": (FedYogi, 0.01, MOVED),
           "fedadagrad": (FedAdagrad, 0.01, ("server_lr", "server_tau", "wire_dtype"))}


@pytest.mark.parametrize("name", list(CLASSES))
def test_each_is_one_method_class_whose_fields_are_its_options(name):
    cls, server_lr, own = CLASSES[name]
    info = method_info(name)
    assert issubclass(cls, Method) and info.cls is cls and getattr(hiso.methods, cls.__name__) is cls
    assert tuple(fields_of(cls)) == own and not set(MOVED) & set(RunConfig.model_fields)
    assert (info.family, info.server_lr, info.server_opt, info.display) == ("full-model", server_lr, cls.server_opt,
                                                                            cls.display)
    cfg = load_config(None, algorithm=name)
    method = info.build(cfg)
    assert type(method) is cls and method.server_lr is None and method.resolved_server_lr == server_lr
    assert cfg.method_opts == {f: getattr(method, f) for f in own}  # every field recorded, server_lr None
    given = load_config(None, algorithm=name, server_lr=0.3, wire_dtype="float16")
    assert info.build(given).resolved_server_lr == 0.3 and info.build(given).wire_dtype == "float16"


def _run(tmp_path, capsys, name, algorithm, *args):
    code, _, err = run_cli(["run", "--out", str(tmp_path / name), *TINY, "--algorithm", algorithm, *args], capsys)
    assert code == 0, err
    return (tmp_path / name / "model.pt").read_bytes(), json.loads((tmp_path / name / "config.json").read_text())


@pytest.mark.parametrize("algorithm, opts", [
    ("fedadam", {"server_lr": 0.05, "beta1": 0.5, "beta2": 0.9, "server_tau": 0.01, "wire_dtype": "bfloat16"}),
    ("ferret", {"server_lr": 0.5}),  # Ferret's own server step, the same flag
])
def test_flag_method_opt_toml_key_and_method_table_run_the_same_bits(tmp_path, capsys, algorithm, opts):
    def toml(v):
        return f'"{v}"' if isinstance(v, str) else v
    toml_flat, toml_table = tmp_path / "flat.toml", tmp_path / "table.toml"
    toml_flat.write_text("".join(f"{k} = {toml(v)}\n" for k, v in opts.items()))
    toml_table.write_text("[method]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in opts.items()))
    ways = {"flags": [a for k, v in opts.items() for a in (f"--{k.replace('_', '-')}", str(v))],
            "method-opt": [a for k, v in opts.items() for a in ("--method-opt", f"{k}={v}")],
            "toml": ["--config", str(toml_flat)], "table": ["--config", str(toml_table)], "default": []}
    runs = {name: _run(tmp_path, capsys, name, algorithm, *args) for name, args in ways.items()}
    assert all(runs[name][0] == runs["flags"][0] for name in ways if name != "default")
    assert runs["default"][0] != runs["flags"][0]  # the options did act
    for name in ways:
        saved = runs[name][1]
        assert saved["schema"] == compat.SCHEMA and not set(MOVED) & set(saved)
        assert {k: saved["method_opts"][k] for k in opts} == (opts if name != "default" else
                                                              {k: compat.FLAT_DEFAULTS[k] for k in opts})


@pytest.mark.parametrize("kind", ["fedadam", "fedyogi", "fedadagrad"])
def test_each_option_reaches_the_server_optimiser(kind):
    """Each field alone changes the adaptive server's model (the run computes with the class's values)."""
    from hiso.runners.fullmodel import FullModelSimulation
    from hiso.tasks.quadratic import QuadraticTask

    def model(**kw):
        sim = FullModelSimulation(QuadraticTask(3, seed=1, dim=4), RunConfig(
            algorithm=kind, clients=3, sampled=3, dim=4, lr=0.2, **kw))
        for _ in range(3):
            sim.step()
        return sim.model.x.detach().clone()
    base = model()
    changes = {"server_lr": 0.05, "server_tau": 0.1, **({"beta1": 0.5, "beta2": 0.5} if kind != "fedadagrad" else {})}
    for name, value in changes.items():
        assert not bool((model(**{name: value}) == base).all()), name
    assert bool((model(server_lr=0.01) == base).all())  # the class's default, given


def test_an_option_of_another_method_is_named_and_not_kept(tmp_path, capsys):
    for algorithm, flag, value, whose in (("fedavg", "--beta1", "0.5", "fedadam's and fedyogi's server moments"),
                                          ("fedadagrad", "--beta2", "0.5", "fedadam's and fedyogi's server moments"),
                                          ("hiso", "--server-lr", "0.5", "the full-model baselines' and ferret's "
                                                                          "server step"),
                                          ("decomfl", "--wire-dtype", "float16", "the full-model baselines' messages"),
                                          ("ferret", "--server-tau", "0.1", "the adaptive server optimisers'")):
        out = tmp_path / algorithm
        code, _, err = run_cli(["run", "--out", str(out), *TINY, "--algorithm", algorithm, flag, value], capsys)
        name = flag[2:].replace("-", "_")
        assert code == 0 and f"{algorithm} does not use {name} ({whose})" in err, err
        saved = json.loads((out / "config.json").read_text())
        assert name not in saved and name not in saved["method_opts"]


@pytest.mark.parametrize("args, needle", [
    (["--algorithm", "fedadam", "--beta1", "1.5"], "beta1 must be in [0, 1)"),
    (["--algorithm", "fedyogi", "--method-opt", "server_tau=0"], "server_tau must be > 0"),
    (["--algorithm", "fedavg", "--server-lr", "-1"], "server_lr must be > 0"),
    (["--algorithm", "sketch", "--method-opt", "server_lr=0"], "server_lr must be > 0"),
    (["--algorithm", "fedzo", "--method-opt", "wire_dtype=int8"], "wire_dtype must be one of float32, float16"),
    (["--algorithm", "fedavg", "--method-opt", "beta1=0.5"], "fedavg has no such option"),
    # server momentum is a stage of the seed-and-scalar fold: a full-model run took it and ignored it
    (["--algorithm", "fedadam", "--momentum", "0.9"], "momentum is for hiso, decomfl and greedy, not fedadam"),
])
def test_the_class_checks_its_own_options_in_one_line(tmp_path, capsys, args, needle):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *TINY, *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def _schema4(cfg: RunConfig) -> dict:
    """``cfg`` as hiso wrote it at schema 4: the full-model options and the server step flat in
    every run, at their defaults but in the run's method's; the methods' other options in
    method_opts."""
    values = dumped_flat(cfg)  # the task options flat too, as then
    opts = dict(values.pop("method_opts"))
    flat = {k: opts.pop(k) if k in opts else d for k, d in compat.FLAT_OPTIONS["fedadam"].items()}
    return {"schema": 4, **values, **flat, "method_opts": opts}


@pytest.mark.parametrize("kw", [dict(algorithm="fedavg", server_lr=0.5), dict(algorithm="fedadam", beta1=0.8,
                                                                              wire_dtype="float16"),
                                dict(algorithm="fedadagrad", server_tau=0.01), dict(algorithm="fedzo"),
                                dict(algorithm="ferret", server_lr=0.3, ferret_k=4), dict(algorithm="sketch"),
                                dict(algorithm="hiso", nu=0.2), dict(algorithm="fedkseed")])
def test_a_schema_4_configuration_with_the_flat_keys_reads_as_today_with_the_same_hash(kw):
    cfg = load_config(None, **kw)
    old = _schema4(cfg)
    raw, _ = compat.migrate(old)
    assert RunConfig(**raw).model_dump() == cfg.model_dump() and not set(MOVED) & set(raw)
    # the hash is the one the flat configuration had: every method's options flat, method_opts {}
    # left out, a later field left out at its default
    flat = {k: v for k, v in old.items() if k != "schema"}
    opts = dict(flat.pop("method_opts"))
    for k, d in compat.FLAT_DEFAULTS.items():
        if k not in flat:
            flat[k] = opts.pop(k) if k in compat.FLAT_OPTIONS.get(cfg.algorithm, {}) and k in opts else d
    if opts:
        flat["method_opts"] = opts
    assert config_sha256(cfg) == flat_config_hash(flat)


def test_ferret_fingerprint_keeps_its_resolved_server_step():
    from hiso.core.join import config_blob
    assert json.loads(config_blob(load_config(None, algorithm="ferret").zo()))["ferret"]["server_lr"] == 1.0
    assert json.loads(config_blob(load_config(None, algorithm="ferret", server_lr=0.3).zo()))["ferret"][
        "server_lr"] == 0.3


def test_plan_and_the_documented_comparison_take_the_full_model_options():
    from pathlib import Path

    from hiso.experiments.compare_plan import build_plan, parse_cli
    from hiso.runners.plan import Deployment, plan
    names = list(CLASSES)
    rows = plan(names, Deployment(params=1000, clients=10, sampled=2, rounds=5))
    assert [r["method"] for r in rows] == names and len({r["up"] for r in rows}) == 1 and rows[0]["up"] > 0
    # configs/mnist_full_all.toml: [compare.overrides.fedadagrad] server_lr = 0.03 reaches its arm only
    conf = Path(__file__).resolve().parent.parent / "configs" / "mnist_full_all.toml"
    cmp_plan = build_plan(conf, {}, parse_cli(algorithms=None))
    server_lr = {a.name: cmp_plan.config(a, a.lrs[0], 0).method_opts.get("server_lr", "-") for a in cmp_plan.arms}
    assert server_lr == {"hiso": "-", "decomfl": "-", "fedzo": None, "fedavg": None, "fedadam": 0.01,
                         "fedyogi": 0.01, "fedadagrad": 0.03}


def test_a_full_model_run_that_recorded_a_momentum_reads_without_it(tmp_path, capsys):
    """Before the full-model baselines refused --momentum they recorded it and ran without it:
    such a run directory reads (rebuild, eval, export) as the run it was, momentum none."""
    from hiso.runners.runfiles import saved_config
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--out", str(out), *TINY, "--algorithm", "fedavg"], capsys)
    assert code == 0, err
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "momentum": 0.9}))
    cfg, _ = saved_config(out)
    assert cfg.momentum is None and cfg.algorithm == "fedavg"
