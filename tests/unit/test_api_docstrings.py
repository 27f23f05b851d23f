"""Every public function of the Horovod-compatible API documents itself in Google style: a
docstring with ``Returns:`` and, when the function takes parameters, an ``Args:`` section that
names each parameter of its signature (and no other)."""
from __future__ import annotations

import inspect
import re
from typing import Callable, List, Optional, Set, Tuple

import pytest

import hvd_slim
from hvd_slim.runtime import basics

API_MODULES = ("hvd_slim.api.collectives", "hvd_slim.api.async_ops", "hvd_slim.api.functions",
               "hvd_slim.api.join", "hvd_slim.api.lifecycle", "hvd_slim.api.process_sets",
               "hvd_slim.api.scatter", "hvd_slim.api.alltoall", "hvd_slim.api.grouped",
               "hvd_slim.api.sparse", "hvd_slim.api.timeline", "hvd_slim.api.sync_batch_norm",
               "hvd_slim.runtime.basics", "hvd_slim.runtime.build_flags",
               "hvd_slim.optim.optimizer", "hvd_slim.optim.distributed_optimizer")
SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?|Attributes):\s*$")
# An entry of the Args section: four spaces, the name (``*args``/``**kwargs`` with their stars),
# an optional ``(type)``, then a colon.
ENTRY = re.compile(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:(?:\s|$)")


def _api() -> List[Tuple[str, Callable]]:
    """The functions hvd_slim re-exports from the API modules, and the runtime's public ones
    (``job_comm``, ``job_collectives``, ``world_transport``)."""
    found = {}
    for owner, names in ((hvd_slim, hvd_slim.__all__), (basics, basics.__all__)):
        for name in names:
            obj = getattr(owner, name)
            if inspect.isfunction(obj) and obj.__module__ in API_MODULES:
                found[name] = obj
    return sorted(found.items())


API = _api()
# The classes hvd_slim re-exports from the API modules: their docstring's Args section names the
# constructor's parameters; their public methods are checked like the functions above.
CLASSES = sorted((name, getattr(hvd_slim, name)) for name in hvd_slim.__all__
                 if inspect.isclass(getattr(hvd_slim, name))
                 and getattr(hvd_slim, name).__module__ in API_MODULES)
METHODS = sorted((f"{name}.{key}", fn) for name, cls in CLASSES for key, fn in vars(cls).items()
                 if inspect.isfunction(fn) and not key.startswith("_"))


def _section(doc: str, title: str) -> Optional[List[str]]:
    """The lines of section ``title`` (without its header), or None when there is none."""
    lines = doc.splitlines()
    try:
        start = lines.index(f"{title}:")
    except ValueError:
        return None
    body = []
    for line in lines[start + 1:]:
        if SECTION.match(line):
            break
        body.append(line)
    return body


def _documented_args(doc: str) -> Optional[Set[str]]:
    body = _section(doc, "Args")
    if body is None:
        return None
    return {m.group(1) for m in map(ENTRY.match, body) if m}


def _parameters(fn: Callable) -> Set[str]:
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return {stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values()}


def test_the_api_is_found() -> None:
    names = {name for name, _ in API}
    assert {"allreduce", "synchronize", "broadcast_parameters", "init", "rank",
            "DistributedOptimizer", "job_collectives", "world_transport"} <= names
    assert len(names) >= 40
    assert [name for name, _ in CLASSES] == ["ProcessSet", "SyncBatchNorm"]
    assert {"SyncBatchNorm.forward", "ProcessSet.rank"} <= set(dict(METHODS))


@pytest.mark.parametrize("name,fn", API + METHODS, ids=[name for name, _ in API + METHODS])
def test_docstring_has_args_and_returns(name: str, fn: Callable) -> None:
    doc = inspect.getdoc(fn)
    assert doc, f"{name} has no docstring"
    assert doc.splitlines()[0].strip(), f"{name}: the docstring must open with a summary line"
    returns = _section(doc, "Returns")
    assert returns is not None and any(line.strip() for line in returns), \
        f"{name}: the docstring needs a non-empty 'Returns:' section"
    _check_args(name, doc, _parameters(fn) - ({"self"} if "." in name else set()))


@pytest.mark.parametrize("name,cls", CLASSES, ids=[name for name, _ in CLASSES])
def test_class_docstring_has_constructor_args(name: str, cls: type) -> None:
    doc = inspect.getdoc(cls)
    assert doc and doc.splitlines()[0].strip(), f"{name}: the docstring must open with a summary line"
    _check_args(name, doc, _parameters(cls))


def _check_args(name: str, doc: str, params: Set[str]) -> None:
    documented = _documented_args(doc)
    if not params:
        assert documented is None, f"{name} takes no arguments: drop its 'Args:' section"
        return
    assert documented is not None, f"{name}: the docstring needs an 'Args:' section"
    assert params - documented == set(), f"{name}: 'Args:' misses {sorted(params - documented)}"
    assert documented - params == set(), \
        f"{name}: 'Args:' names {sorted(documented - params)}, which are not parameters"


def test_the_checks_can_fail() -> None:
    def undocumented(tensor, name=None):
        """Does something."""

    def half_documented(tensor, name=None):
        """Does something.

        Args:
            tensor: A tensor.

        Returns:
            Nothing.
        """

    assert _section(inspect.getdoc(undocumented), "Returns") is None
    assert _documented_args(inspect.getdoc(undocumented)) is None
    assert _parameters(half_documented) - _documented_args(inspect.getdoc(half_documented)) \
        == {"name"}
