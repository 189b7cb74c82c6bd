"""Methods as plugins: one registry answers what a method is and can do; no source file outside
it compares a method's name, and a user's method is named like a user's task (module:Class)."""

import ast
import re
from pathlib import Path

import pytest

from hiso.config import ConfigError, RunConfig, load_config
from hiso.methods.registry import METHOD_OPTIONS, MethodInfo, method_info, method_names

SRC = Path(__file__).resolve().parent.parent / "src" / "hiso"
REGISTRY = {SRC / "methods" / "registry.py"}
# the comparisons that stay, each with its reason
SURVIVORS: dict = {
    ("compat.py", "ferret"): "the key Ferret's fields have in the fingerprint blob of old runs (FINGERPRINT_LEGACY_KEY), "
                             "not a run's algorithm",
}


def _name_comparisons(path: Path, names: set[str]):
    """(line, name) of each ``==``/``!=``/``in`` comparison between a string naming a method and anything."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        for part in parts:
            consts = [part] if isinstance(part, ast.Constant) else list(getattr(part, "elts", []))
            for c in consts:
                if isinstance(c, ast.Constant) and c.value in names:
                    yield node.lineno, c.value


def test_no_source_file_outside_the_registry_compares_a_method_name():
    names = set(method_names())
    found = {}
    for f in sorted(SRC.rglob("*.py")):
        if f in REGISTRY:
            continue
        for line, name in _name_comparisons(f, names):
            key = (str(f.relative_to(SRC)), name)
            if key not in SURVIVORS:
                found.setdefault(key, []).append(line)
    # an option group named like a method ("ferret" in info.options) is not a method's name
    found = {k: v for k, v in found.items() if not (k[1] in METHOD_OPTIONS)}
    assert not found, f"method names compared outside the registry: {found}"


FAMILIES = {"scalar", "seed-pool", "full-model"}


def _family_comparisons(path: Path):
    """(line, what) of each comparison of a method's family: ``x.family`` compared, or a family's
    name compared with anything."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for part in [node.left, *node.comparators]:
            if isinstance(part, ast.Attribute) and part.attr == "family":
                yield node.lineno, "family"
            consts = [part] if isinstance(part, ast.Constant) else list(getattr(part, "elts", []))
            yield from ((node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in FAMILIES)


def test_no_source_file_outside_the_registry_compares_a_method_family():
    """What a method's family decides (its log, its wire, its rounds) is asked of its MethodInfo."""
    found = {}
    for f in sorted(SRC.rglob("*.py")):
        if f in REGISTRY:
            continue
        for line, what in _family_comparisons(f):
            found.setdefault(str(f.relative_to(SRC)), []).append((line, what))
    assert not found, f"method families compared outside the registry: {found}"


def test_the_family_counter_sees_a_comparison(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text('if cfg.method.family == "seed-pool" or kind in ("full-model",):\n    pass\n')
    assert sorted(w for _, w in _family_comparisons(p)) == ["family", "full-model", "seed-pool"]


def test_the_counter_sees_a_comparison():
    src = 'if cfg.algorithm == "fedkseed" or alg in ("hiso", "x"):\n    pass\n'
    p = Path(__file__).parent / "_tmp_compare_probe.py"
    try:
        p.write_text(src)
        assert sorted(n for _, n in _name_comparisons(p, {"fedkseed", "hiso"})) == ["fedkseed", "hiso"]
    finally:
        p.unlink()


def test_every_builtin_method_is_registered_with_what_it_declares():
    assert method_names()[:5] == ("hiso", "decomfl", "feedsign", "ferret", "fedkseed")
    for name in method_names():
        info = method_info(name)
        assert info.name == name and info.display
    assert [n for n in method_names() if method_info(n).family == "scalar"] == ["hiso", "decomfl", "feedsign", "ferret",
                                                                          "sketch", "fedkrso", "greedy", "conmezo"]
    assert [n for n in method_names() if method_info(n).family == "full-model"] == ["fedzo", "fedavg", "fedadam", "fedyogi",
                                                                         "fedadagrad"]


def test_every_name_of_the_algorithm_list_is_built_from_one_method_class_in_hiso_methods():
    """What ``hiso run --algorithm`` lists: each built-in name is one Method subclass of a module
    of hiso.methods, named by hiso.methods, whose instance the run builds."""
    import hiso.methods
    from hiso.cli_flags import field_choices
    from hiso.core.method import Method
    names = [n for n in field_choices("algorithm") if ":" not in n]
    assert names == list(method_names()) and len(names) == 14
    for name in names:
        cls = method_info(name).cls
        assert isinstance(cls, type) and issubclass(cls, Method), name
        assert cls.__module__.startswith("hiso.methods.") and getattr(hiso.methods, cls.__name__) is cls, name
        assert type(method_info(name).build(load_config(None, algorithm=name))) is cls, name
    assert len({method_info(n).cls for n in names}) == len(names)  # one class each


def test_a_method_declaring_an_unknown_capability_is_refused():
    with pytest.raises(ValueError, match="unknown capabilities"):
        MethodInfo("x", "X", can=frozenset({"teleport"}))
    with pytest.raises(ValueError, match="family"):
        MethodInfo("x", "X", family="fancy")


def test_an_option_needing_a_capability_the_method_lacks_is_refused_by_name():
    for alg, opt, words in (("feedsign", {"dp_clip": 1.0, "dp_noise_multiplier": 1.0}, "differential privacy"),
                            ("ferret", {"scalar_dtype": "int8"}, "int8"),
                            ("fedavg", {"drop_rate": 0.1}, "faults")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, algorithm=alg, **opt)


def test_an_unknown_method_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=re.escape("unknown algorithm 'nope' (choose from hiso, decomfl")):
        load_config(None, algorithm="nope")


def test_a_users_method_is_loaded_from_module_colon_class(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from dataclasses import dataclass\nimport numpy as np\nfrom hiso.core.method import Method\n\n"
                 "@dataclass(frozen=True)\nclass Sign(Method):\n    display = 'ZO-sign'\n"
                 "    def step_scalars(self, g):\n        return np.sign(g).astype(np.float32)\n")
    cfg = RunConfig(algorithm=f"{f}:Sign", rounds=2)
    assert cfg.method.family == "scalar" and cfg.method.display == "ZO-sign" and type(cfg.zo().method).__name__ == "Sign"
    # a refusal names the capability the method does not declare, and how to declare it
    with pytest.raises(ConfigError, match="differential privacy needs the capability 'dp', which ZO-sign does not "
                       "declare: if it supports it, add 'dp' to its class's `can`"):
        load_config(None, algorithm=f"{f}:Sign", dp_clip=1.0, dp_noise_multiplier=1.0)
    (tmp_path / "bad.py").write_text("class NotAMethod:\n    pass\n")
    with pytest.raises(ConfigError, match="is not a subclass of hiso.core.method.Method"):
        load_config(None, algorithm=f"{tmp_path / 'bad.py'}:NotAMethod")
