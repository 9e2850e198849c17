"""The registry of every extension point: registered names, lazy entries, ``module:attr`` and its errors."""

from __future__ import annotations

from typing import Protocol

import pytest

from turnrl.registry import Registry, RegistryError, check_callable, is_module_attr


def write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_registered_name_gives_its_object_by_call_or_decorator():
    registry: Registry[object] = Registry("thing")
    first = registry.register("first", len)

    @registry.register("second")
    def second() -> int:
        return 2

    assert first is len and registry.get("first") is len and registry.get("second") is second
    assert registry.names() == ("first", "second") and "second" in registry


def test_a_lazy_entry_imports_its_module_only_when_asked(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "registry_lazy_ext", "import sys\nVALUE = 42\n")
    registry: Registry[int] = Registry("thing")
    registry.register("answer", "registry_lazy_ext:VALUE")
    assert registry.names() == ("answer",) and registry.target("answer") == "registry_lazy_ext:VALUE"
    assert registry.get("answer") == 42 and registry.target("answer") == 42


def test_module_attr_names_an_object_of_a_users_package(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "registry_user_ext",
                 "class Holder:\n    value = 7\n\ndef double(x):\n    return 2 * x\n")
    registry: Registry[object] = Registry("thing")
    assert registry.get("registry_user_ext:double")(3) == 6  # type: ignore[operator]
    assert registry.get("registry_user_ext:Holder.value") == 7
    assert registry.names() == ()  # naming it does not register it


def test_coerce_checks_what_module_attr_names(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "registry_coerce_ext", "NUMBER = 3\nTEXT = 'x'\n")

    def as_int(obj: object) -> int:
        if not isinstance(obj, int):
            raise TypeError(f"a thing is an int, got {type(obj).__name__}")
        return obj

    registry: Registry[int] = Registry("thing", coerce=as_int)
    assert registry.get("registry_coerce_ext:NUMBER") == 3
    with pytest.raises(TypeError, match="a thing is an int, got str"):
        registry.get("registry_coerce_ext:TEXT")


def test_an_unknown_name_lists_the_registered_ones_with_the_likely_one():
    registry: Registry[int] = Registry("estimator")
    registry.register("grpo", 1)
    registry.register("gae", 2)
    with pytest.raises(RegistryError) as info:
        registry.get("gpro")
    message = str(info.value)
    assert "no estimator named 'gpro'; registered: ['grpo', 'gae']; did you mean grpo?" in message
    assert "module:attr" in message
    assert "did you mean" not in str(pytest.raises(RegistryError, registry.get, "zzz").value)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("registry_missing_ext:thing", "cannot import module 'registry_missing_ext'"),
        ("registry_bad_ext:Valeu", "module 'registry_bad_ext' has no attribute 'Valeu'; did you mean Value?"),
        ("registry_broken_ext:anything", "importing 'registry_broken_ext' failed: ZeroDivisionError"),
    ],
)
def test_a_module_attr_that_cannot_be_imported_says_which_part_failed(tmp_path, monkeypatch, name, expected):
    write_module(tmp_path, monkeypatch, "registry_bad_ext", "Value = 1\n")
    write_module(tmp_path, monkeypatch, "registry_broken_ext", "1 / 0\n")
    with pytest.raises(RegistryError, match=expected):
        Registry("thing").get(name)


def test_a_module_that_imports_a_missing_package_names_that_package_not_the_path(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "registry_needsdep_ext", "import registry_not_installed_dep\n")
    with pytest.raises(RegistryError) as info:
        Registry("thing").get("registry_needsdep_ext:anything")
    message = str(info.value)
    assert "importing registry_needsdep_ext failed: No module named 'registry_not_installed_dep'" in message
    assert "install" in message and "Python path" not in message
    with pytest.raises(RegistryError, match="cannot import module 'registry_no_package_ext.sub'.*Python path"):
        Registry("thing").get("registry_no_package_ext.sub:anything")  # its package is what is missing


@pytest.mark.parametrize("target", ["typo", "my_package.module", "my_package.envs:Corridor-v0", "a b:c", "a.:b"])
def test_a_lazy_entry_is_refused_at_registration_unless_written_module_attr(target):
    registry: Registry[object] = Registry("thing")
    with pytest.raises(ValueError, match=r"a string registers a lazy entry, written package.module:attr"):
        registry.register("lazy", target)
    assert "lazy" not in registry
    registry.register("lazy", "my_package.module:Outer.inner")  # nothing is imported until it is looked up
    assert registry.target("lazy") == "my_package.module:Outer.inner"


class Scorer(Protocol):
    def __call__(self, turns: list[str], settings: dict, /) -> float: ...


class CallableScorer:
    def __call__(self, turns, settings):
        return 0.0


def two_arguments(turns, settings, extra=None):
    return 0.0


def one_argument(turns):
    return 0.0


def test_check_callable_takes_what_binds_the_protocols_arguments():
    check_callable(two_arguments, Scorer, "a scorer")
    check_callable(CallableScorer(), Scorer, "a scorer")
    check_callable(max, Scorer, "a scorer")  # a built-in: no signature to check


@pytest.mark.parametrize(
    ("obj", "got"),
    [
        (CallableScorer, "got the class tests.test_registry:CallableScorer, not a function or an instance"),
        (3, "got a value of type int, which is not callable"),
        (one_argument, r"got tests.test_registry:one_argument\(turns\), which cannot take those arguments \(too many"),
    ],
)
def test_check_callable_refuses_a_class_a_value_and_a_signature_that_cannot_bind(obj, got):
    with pytest.raises(TypeError) as info:
        check_callable(obj, Scorer, "a scorer")
    assert str(info.value).startswith("a scorer must be a function or callable object taking (turns, settings) and "
                                      "returning float (tests.test_registry.Scorer); ")
    info.match(got)


def test_a_name_is_registered_once_and_never_with_a_colon():
    registry: Registry[object] = Registry("thing")
    registry.register("a", len)
    registry.register("a", len)  # the same object again: a module imported twice
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", abs)
    with pytest.raises(ValueError, match="without ':'"):
        registry.register("pkg:a", abs)


@pytest.mark.parametrize(("name", "expected"), [("a.b:c", True), ("a:c.d", True), ("gae", False), (":c", False),
                                                ("a:", False)])
def test_is_module_attr(name, expected):
    assert is_module_attr(name) is expected
