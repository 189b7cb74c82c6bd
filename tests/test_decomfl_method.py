"""DeComFL is a Method class of its own (methods/decomfl.py) whose runs are those of no method:
the same hooks, the same protocol fingerprint, so old runs and peers stay this configuration's."""

import dataclasses
import json

import numpy as np
import pytest

from hiso.config import RunConfig, load_config
from hiso.core.config import ZOConfig
from hiso.core.join import config_blob, config_fingerprint
from hiso.core.method import Method
from hiso.methods.decomfl import DeComFL, decomfl
from hiso.methods.registry import method_info


def test_decomfl_is_a_method_class_without_fields_built_by_the_registry():
    info = method_info("decomfl")
    assert issubclass(DeComFL, Method) and info.cls is DeComFL and info.family == "scalar"
    assert dataclasses.fields(DeComFL) == ()
    zo = RunConfig(algorithm="decomfl").zo()
    assert type(zo.method) is DeComFL and decomfl(0.1).method == DeComFL()


@pytest.mark.parametrize("kw", [{}, {"local_steps": 2, "perturbations": 3, "scalar_dtype": "bfloat16"},
                                {"momentum": 0.9}, {"dp_clip": 1.0, "dp_noise_multiplier": 1.0}])
def test_decomfls_fingerprint_is_the_one_without_a_method(kw):
    zo = load_config(None, algorithm="decomfl", task="quadratic", **kw).zo()
    bare = ZOConfig(**{**zo.__dict__, "method": None})
    assert config_blob(zo) == config_blob(bare) and config_fingerprint(zo) == config_fingerprint(bare)
    assert "method" not in json.loads(config_blob(zo))


def test_decomfl_refuses_method_options_as_before():
    with pytest.raises(ValueError, match="decomfl has no options of its own"):
        RunConfig(algorithm="decomfl", method_opts={"c": 1})


def test_a_run_of_decomfls_class_is_a_run_without_a_method():
    from hiso.runners.simulate import Simulation
    from conftest import TinyTask
    zo = decomfl(0.05, perturbations=3, local_steps=2)
    runs = [Simulation(TinyTask(num_clients=6), z, clients_per_round=3, seed=2, batch_size=8, eval_every=100)
            for z in (zo, ZOConfig(**{**zo.__dict__, "method": None}))]
    for sim in runs:
        for _ in range(3):
            sim.step()
    a, b = (sim.server.history for sim in runs)
    assert all(np.array_equal(x.scalars, y.scalars) for x, y in zip(a, b)) and len(a) == 3
    assert all(np.array_equal(p.detach().numpy(), q.detach().numpy())
               for p, q in zip(runs[0].state.params, runs[1].state.params))
