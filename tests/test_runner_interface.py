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


# what a method's family decides is asked of its driver (hiso.runners.drivers) or its registry
# entry; the places that still ask the family by name, outside the registry, may only go down
FAMILY_QUESTIONS_LEFT = 31  # 42 before the drivers


def test_the_family_is_asked_by_name_in_fewer_places_only():
    src = Path(hiso.__file__).parent
    asked = [f"{path.relative_to(src)}:{node.lineno}"
             for path in sorted(src.rglob("*.py")) if path.relative_to(src).as_posix() != "methods/registry.py"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in ("scalar_only", "pool_log", "has_log")]
    assert len(asked) <= FAMILY_QUESTIONS_LEFT, asked
