"""A run asks its runner's attributes (hiso.runners.runner.Runner) and never probes for them."""

import ast
from pathlib import Path

import hiso


def test_every_runner_is_a_runner():
    from hiso.flower.fullmodel import FullModelFederation
    from hiso.flower.secagg import SecAggFederation
    from hiso.flower.server_app import FlowerFederation
    from hiso.runners.fullmodel import FullModelSimulation
    from hiso.runners.inprocess import FedKSeedSimulation
    from hiso.runners.runner import Runner
    from hiso.runners.simulate import Simulation

    for cls in (Simulation, FedKSeedSimulation, FullModelSimulation, FlowerFederation, FullModelFederation,
                SecAggFederation):
        assert issubclass(cls, Runner), cls


def test_no_code_probes_a_runner_for_an_attribute():
    src = Path(hiso.__file__).parent
    probes = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args):
                target = node.args[0]
                if ((isinstance(target, ast.Name) and target.id in ("sim", "runner"))
                        or (isinstance(target, ast.Attribute) and target.attr == "runner")
                        or (isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
                            and target.func.id == "getattr" and isinstance(target.args[0], ast.Name)
                            and target.args[0].id == "sim")):
                    probes.append(f"{path.relative_to(src)}:{node.lineno}")
    assert probes == []


# every hasattr outside the registry probes an object hiso does not define (argparse's namespace,
# transformers' models, os, Flower's records, torch's tensor subclasses) or checks a user's codec
# against the contract; none asks a method, task or runner what it is
THIRD_PARTY_PROBES = {
    "cli_commands.py": ["args"], "tasks/lm_head.py": ["model"], "tasks/lm.py": ["m", "model.config", "t"],
    "tasks/lm_stream.py": ["os"], "flower/records.py": ["rec", "rec"], "runners/client_cost.py": ["t"],
    "core/uplink.py": ["codec"],
}


def test_every_hasattr_outside_the_registry_probes_what_hiso_does_not_define():
    src = Path(hiso.__file__).parent
    found: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == "methods/registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                found.setdefault(rel, []).append(ast.unparse(node.args[0]))
    assert {k: sorted(v) for k, v in found.items()} == THIRD_PARTY_PROBES


# what a method's family decides is asked of its driver (hiso.runners.drivers) by what it needs, or,
# below the drivers, of its registry entry by what it needs: never by the family's old names
FAMILY_QUESTIONS_LEFT = 0  # 42 before the drivers, 31 after, then 7 under other names


def _attribute_reads(names, skip=("methods/registry.py",)) -> list[str]:
    src = Path(hiso.__file__).parent
    return [f"{path.relative_to(src).as_posix()}:{node.lineno}"
            for path in sorted(src.rglob("*.py")) if path.relative_to(src).as_posix() not in skip
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in names]


def test_the_family_is_not_asked_by_name_outside_the_registry():
    asked = _attribute_reads(("scalar_only", "pool_log", "has_log", "core_log", "plays_pool", "rebuildable"))
    assert len(asked) == FAMILY_QUESTIONS_LEFT, asked


def _family_properties() -> set[str]:
    """MethodInfo's properties whose answer is read off its family."""
    from hiso.methods import registry
    tree = ast.parse(Path(registry.__file__).read_text())
    info = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MethodInfo")
    return {f.name for f in info.body if isinstance(f, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
            and any(isinstance(n, ast.Attribute) and n.attr == "family" for n in ast.walk(f))}


def test_the_registry_entry_answers_nothing_off_the_family():
    """What a method's family decides is its driver's answer (hiso.runners.drivers), asked by need;
    below the drivers (config, the run files) nothing needs it: the rules are the method's
    capabilities and classes, and continuing a run (hiso.runners.continuing) asks the driver."""
    assert _family_properties() == set()


def test_each_drivers_answers_agree_with_its_methods_registry_entry():
    from hiso.config import RunConfig
    from hiso.methods.registry import method_info, method_names
    from hiso.runners.drivers import driver_of

    for name in method_names():
        info, driver = method_info(name), driver_of(method_info(name))
        core_log = info.family == "scalar"
        assert driver.keeps_log == (info.family != "full-model") and driver.pool_rounds == (info.family == "seed-pool")
        assert driver.replica_catches_up == driver.checkpointed == core_log, name
        assert (driver.model_from == "log") == core_log, name
        shape = driver.record_shape(RunConfig(task="quadratic", algorithm=name, rounds=2))
        assert (shape is not None) == core_log, name
