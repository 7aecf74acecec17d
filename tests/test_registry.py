"""The one registry type (pflkit.registry.Registry): the same add, refusal and lookup for
algorithms, models, datasets and partitioners."""

from dataclasses import dataclass

import pytest

from pflkit.algorithms import ALGORITHMS
from pflkit.data.partition import PARTITIONERS
from pflkit.data.sources import SOURCES
from pflkit.errors import PflkitError
from pflkit.models import MODELS
from pflkit.registry import Registry


@dataclass(frozen=True)
class Info:
    name: str
    description: str
    fn: object
    extra: int = 0


def first(x):
    return x


def second(x):
    return x


def test_register_wraps_the_function_and_returns_it_unchanged():
    reg = Registry("widget", Info)
    assert reg.register("one", "the first", extra=3)(first) is first
    assert reg.lookup("one") == Info("one", "the first", first, 3)
    assert reg.descriptions() == {"one": "the first"}


def test_a_second_entry_under_a_taken_name_is_refused_but_the_same_one_again_is_not():
    reg = Registry("widget", Info)
    reg.register("one", "the first")(first)
    reg.register("one", "the first")(first)  # a module imported twice registers again
    with pytest.raises(PflkitError, match="a widget named 'one' is already registered"):
        reg.register("one", "another")(second)
    assert reg["one"].fn is first


def test_lookup_of_an_unknown_name_suggests_the_closest():
    reg = Registry("widget", Info, [Info("dirichlet", "d", first)])
    with pytest.raises(PflkitError, match="unknown widget 'dirichelt': did you mean 'dirichlet'"):
        reg.lookup("dirichelt")
    with pytest.raises(PflkitError, match="unknown widget '3'"):
        reg.lookup(3)


def test_an_entry_without_a_name_is_refused_and_a_class_registry_has_no_register():
    with pytest.raises(PflkitError, match="needs a non-empty string name"):
        Registry("widget", Info).add(Info("", "x", first))
    with pytest.raises(TypeError, match="register with add"):
        Registry("algorithm").register("x", "y")


@pytest.mark.parametrize(
    "registry, kind, typo, close",
    [
        (ALGORITHMS, "algorithm", "fedavgg", "fedavg"),
        (MODELS, "model", "cnn5", "cnn4"),
        (SOURCES, "dataset", "fashion_mnits", "fashion_mnist"),
        (PARTITIONERS, "partitioner", "dirichelt", "dirichlet"),
    ],
)
def test_all_four_registries_are_one_type_with_one_error(registry, kind, typo, close):
    assert isinstance(registry, Registry) and registry.kind == kind
    with pytest.raises(PflkitError, match=f"unknown {kind} '{typo}': did you mean '{close}'"):
        registry.lookup(typo)
    name = next(iter(registry))
    with pytest.raises(PflkitError, match=f"a {kind} named '{name}' is already registered"):
        registry.add(type("Other", (), {"name": name, "description": "x"}))


def test_the_readme_counts_the_registered_algorithms():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shipped = [a for a in ALGORITHMS.values() if a.__module__.startswith("pflkit.")]
    assert int(re.search(r"Status: (\d+) algorithms", readme).group(1)) == len(shipped)
