"""One idiom for every extension point: a :class:`Registry` of named objects, each also nameable as
``package.module:attr`` from a user's package.

turnrl's extension points each keep one registry, beside the protocol that says what its objects are:

==========================  ============================================  ==========================================
config key                  registry                                      what it holds
==========================  ============================================  ==========================================
``algorithm.advantage``     ``turnrl.algorithms.estimators.ESTIMATORS``   :class:`EstimatorSpec` (``@estimator``)
``algorithm.policy_loss``   ``turnrl.algorithms.losses.POLICY_LOSSES``    a :class:`PolicyLoss` function
``agent.format``            ``turnrl.agent.formats.FORMATS``              a :class:`FormatBuilder`
``env.id``                  ``turnrl.envs.catalog.ENVS``                  an env class (or factory)
``rewards.extra[].fn``      ``turnrl.rewards.turn_rewards.REWARDS``       a :class:`RewardFn` (or its class)
``model.backend``           ``turnrl.policy.factory.POLICY_BACKENDS``     a :class:`PolicyBackend`
``model.engine.families``   ``turnrl.engine.families.ENGINE_FAMILIES``    a :class:`Family` record
==========================  ============================================  ==========================================

A config value is a registered name (``gae``) or ``module:attr`` (``my_package.advantages:my_estimator``); the
built-in objects register with the same call a user's package would use (``REGISTRY.register(name, obj)``, or
``@REGISTRY.register(name)`` over a function or class). A registration may name its object lazily as a
``"module:attr"`` string, so that listing the names imports nothing (the env and reward registries do: their
modules are heavy, or sit above the registry's layer).

What a ``module:attr`` names is checked when it is resolved, by the registry's ``coerce`` hook: an extension point
whose objects are called (a policy loss, an estimator, a backend...) refuses a class, or a function whose
signature cannot take the arguments the point passes (:func:`check_callable`), so a config naming the wrong
object fails at load time with what is expected, not at its first call.

Why not a library: Python's entry points (``importlib.metadata``) find objects of *installed distributions* by
group, not a ``module:attr`` written in a config string, and ``catalogue`` (spaCy's registries) is entry points
plus a dict; neither says which part of a ``module:attr`` failed, nor the likely name of a typo. The standard
library's :func:`pkgutil.resolve_name` refuses attributes that are not identifiers, which a Gymnasium id after
the colon is (``my_package.envs:Corridor-v0``, an env module that registers ids on import). So the import is
:func:`importlib.import_module` and ``getattr``, the hint :func:`difflib.get_close_matches`; what is written here
is the dict, the lazy entries and the error messages.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "Registry",
    "RegistryError",
    "callable_name",
    "check_callable",
    "close_names",
    "is_import_path",
    "is_module_attr",
    "resolve_module_attr",
]

T = TypeVar("T")
Obj = TypeVar("Obj")


class RegistryError(ValueError):
    """A name that is neither registered nor an importable ``module:attr``; the message says what is."""


def close_names(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The ``names`` closest to a mistyped ``word`` (case ignored), for a "did you mean" hint; none if no name
    is close (difflib's ratio under 0.75, the cut-off of config keys)."""
    by_lower: dict[str, str] = {}
    for name in names:
        by_lower.setdefault(name.lower(), name)
    return [by_lower[near] for near in difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=0.75)]


def is_module_attr(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:attr`` (a colon with text on both sides)."""
    module, colon, attr = name.partition(":")
    return bool(colon and module.strip() and attr.strip())


def is_import_path(name: str) -> bool:
    """Whether ``name`` is ``package.module:attr`` with every dotted part an identifier (the form of a lazy entry)."""
    module, colon, attr = name.partition(":")
    return bool(colon) and all(part.isidentifier() for part in [*module.split("."), *attr.split(".")])


def resolve_module_attr(spec: str, what: str) -> Any:
    """The object ``package.module:attr`` names (``attr`` may be dotted: ``Class.attribute``).

    Raises:
        RegistryError: the module cannot be imported, or has no such attribute (with the likely one of a typo);
            one line that says which.
    """
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if not _names_module_or_parent(error.name, module_name):  # the module exists; what it imports does not
            raise RegistryError(f"{what} {spec!r}: importing {module_name} failed: {error}; install the package "
                                "that provides it") from error
        raise RegistryError(f"{what} {spec!r}: cannot import module {module_name!r} ({error}); is its package on "
                            "the Python path (installed, or its folder in PYTHONPATH)?") from error
    except Exception as error:  # the module exists and failed while importing: say so, whatever it raised
        raise RegistryError(f"{what} {spec!r}: importing {module_name!r} failed: "
                            f"{type(error).__name__}: {error}") from error
    module = obj
    for part in attr.split("."):
        if not hasattr(obj, part):
            near = close_names(attr, [name for name in dir(module) if not name.startswith("_")])
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise RegistryError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _names_module_or_parent(missing: str | None, module_name: str) -> bool:
    """Whether the module a ModuleNotFoundError names (``missing``) is ``module_name`` or a package above it."""
    return missing is not None and (module_name == missing or module_name.startswith(f"{missing}."))


def callable_name(obj: Any) -> str:
    """``module:qualname`` of a function or class; of a callable object, its class's (its repr may be long)."""
    named = obj if isinstance(obj, type) or inspect.isroutine(obj) else type(obj)
    return f"{named.__module__}:{named.__qualname__}"


def _call_shape(protocol: type) -> str:
    """``taking (inputs, settings) and returning Result (package.module.Protocol)``: what a callable protocol's
    ``__call__`` takes after ``self`` and returns, for a message that says what an extension point expects."""
    signature = inspect.signature(protocol.__call__)
    shape = f"taking ({', '.join(list(signature.parameters)[1:])})"
    result = signature.return_annotation
    if result is not inspect.Signature.empty:  # a string under ``from __future__ import annotations``
        shape += f" and returning {result if isinstance(result, str) else inspect.formatannotation(result)}"
    return f"{shape} ({protocol.__module__}.{protocol.__qualname__})"


def check_callable(obj: Any, protocol: type, what: str, *, settings_follow: bool = False) -> None:
    """Raise a TypeError that says what is expected unless ``obj`` can be called as ``protocol.__call__`` says.

    ``obj`` must be a function or a callable object, not a class (a class would be instantiated where the
    extension point calls a function), and its signature must bind as many positional arguments as the
    protocol's ``__call__`` takes (the extension point passes them so). An object whose signature cannot be read
    (a built-in written in C) is taken as it is.

    Args:
        what: the kind of object, with its article, as a message begins (``"a policy loss"``).
        settings_follow: the extension point also passes keyword settings, known only later (a reward
            function's): the positional arguments must bind, the rest may still be missing.
    """
    expected = f"{what} must be a function or callable object {_call_shape(protocol)}"
    if isinstance(obj, type):
        raise TypeError(f"{expected}; got the class {callable_name(obj)}, not a function or an instance")
    if not callable(obj):
        raise TypeError(f"{expected}; got a value of type {type(obj).__name__}, which is not callable")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    arguments = len(inspect.signature(protocol.__call__).parameters) - 1
    bind = signature.bind_partial if settings_follow else signature.bind
    try:
        bind(*(object() for _ in range(arguments)))
    except TypeError as error:
        raise TypeError(f"{expected}; got {callable_name(obj)}{_unannotated(signature)}, which cannot take those "
                        f"arguments ({error})") from error


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without its annotations, which under postponed evaluation print as quoted strings."""
    parameters = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()]
    return signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


class Registry(Generic[T]):
    """Named objects of one kind (``what``: ``"advantage estimator"``), and their ``module:attr`` fallback.

    ``coerce`` turns what a ``module:attr`` (or a lazy entry) names into a ``T``, and refuses what is not one
    with a TypeError that says what is expected; the default takes the object as it is.
    """

    def __init__(self, what: str, coerce: Callable[[Any], T] | None = None) -> None:
        self.what = what
        self._coerce = coerce
        self._entries: dict[str, T | str] = {}

    # ------------------------------------------------------------------ registering
    @overload
    def register(self, name: str) -> Callable[[Obj], Obj]: ...

    @overload
    def register(self, name: str, obj: Obj) -> Obj: ...

    def register(self, name: str, obj: Any = None) -> Any:
        """Register ``obj`` (or, lazily, the ``"module:attr"`` string that names it) as ``name``; returns it.

        Without ``obj``, a decorator that registers the function or class it decorates and returns it unchanged.

        Raises:
            ValueError: ``name`` is taken by another object, or has a colon (it would read as ``module:attr``); or
                a string ``obj`` that is not ``package.module:attr`` (a lazy entry is told from an object by being
                a string, so a typo would otherwise be stored and fail only when first looked up).
        """
        if obj is None:
            return lambda target: self.register(name, target)
        if not name or ":" in name:
            raise ValueError(f"{self.what} name {name!r} must be non-empty and without ':' (that is module:attr)")
        if isinstance(obj, str) and not is_import_path(obj):
            raise ValueError(f"{self.what} {name!r}: a string registers a lazy entry, written package.module:attr "
                             f"(dotted identifiers, e.g. 'my_package.module:MyClass'); got {obj!r}")
        known = self._entries.get(name)
        if known is not None and known is not obj and known != obj:
            raise ValueError(f"a {self.what} named {name!r} is already registered ({_describe(known)})")
        self._entries[name] = obj
        return obj

    # ------------------------------------------------------------------ looking up
    def names(self) -> tuple[str, ...]:
        """Every registered name, in the order of registration."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        """The object registered as ``name``, or the one ``name`` names as ``package.module:attr``.

        Raises:
            RegistryError: an unknown name (the message lists the registered ones, with the likely one of a
                typo), or a ``module:attr`` that cannot be imported.
            TypeError: what ``module:attr`` names is not a ``T`` (the message says what is expected).
        """
        if name in self._entries:
            entry = self._entries[name]
            if not isinstance(entry, str):
                return entry
            resolved = self._entries[name] = self._as_entry(resolve_module_attr(entry, self.what))  # lazy: once
            return resolved
        if isinstance(name, str) and is_module_attr(name):
            return self._as_entry(resolve_module_attr(name, self.what))
        raise RegistryError(self.unknown(name))

    def target(self, name: str) -> T | str:
        """What ``name`` was registered with: the object, or the ``"module:attr"`` string of a lazy entry not yet
        resolved (for a caller that hands it on unresolved, as to ``gymnasium.register``)."""
        return self._entries[name]

    def find(self, obj: Any) -> str | None:
        """The name ``obj`` is registered under (by identity; lazy entries are not resolved), or None."""
        return next((name for name, entry in self._entries.items() if entry is obj), None)

    def values(self) -> list[T]:
        """Every registered object, lazy entries resolved."""
        return [self.get(name) for name in self._entries]

    def unknown(self, name: object) -> str:
        """One line: ``name`` is not a registered name, which are, the likely one of a typo, and ``module:attr``."""
        near = close_names(str(name), self._entries)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        return (f"no {self.what} named {name!r}; registered: {list(self._entries)}; {hint}"
                "or name one in your own package as module:attr")

    def _as_entry(self, obj: Any) -> T:
        return self._coerce(obj) if self._coerce is not None else obj


def _describe(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    return f"{getattr(entry, '__module__', type(entry).__module__)}:{getattr(entry, '__qualname__', repr(entry))}"

