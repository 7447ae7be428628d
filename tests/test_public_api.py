"""``__all__`` and the real public names stay in step (anyio's test_all_attributes)."""

from __future__ import annotations

import inspect

import pytest

import async_stager

pytestmark = pytest.mark.timeout(30)


def test_all_lists_exactly_the_public_names() -> None:
    public = {
        n
        for n in vars(async_stager)
        if not n.startswith("_") and not inspect.ismodule(getattr(async_stager, n))
    }
    assert public - {"annotations"} <= set(async_stager.__all__) | {"testing"}
    for name in async_stager.__all__:
        assert hasattr(async_stager, name), name
    assert list(async_stager.__all__) == sorted(async_stager.__all__, key=lambda n: (n.startswith("_"), n))


def test_public_objects_are_documented_and_homed_in_private_modules() -> None:
    for name in async_stager.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(async_stager, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        module = getattr(obj, "__module__", "")
        assert module.startswith("async_stager."), (name, module)


def test_errors_are_one_hierarchy() -> None:
    for name in async_stager.__all__:
        obj = getattr(async_stager, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, async_stager.StagingError), name


def test_testing_module_exports() -> None:
    from async_stager import testing

    for name in testing.__all__:
        assert hasattr(testing, name)
