"""The seam every backend implements, checked once over all of them: the factories' one
signature, and the one error a missing extra raises."""

from __future__ import annotations

import inspect
import pickle
import sys

import pytest

from prefect_sandbox.blocks import E2BCredentials
from prefect_sandbox.sandbox.backends import daytona, e2b
from prefect_sandbox.sandbox.backends.daytona import DaytonaSandbox
from prefect_sandbox.sandbox.backends.e2b import E2BSandbox
from prefect_sandbox.sandbox.backends.local import LocalKernelSandbox
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import BackendNotInstalledError, SandboxError

BACKENDS = [LocalKernelSandbox, E2BSandbox, DaytonaSandbox]


def _shape(function: object) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("operation", ["create", "attach", "list_handles"])
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda cls: cls.__name__)
def test_factories_have_the_abstract_classs_signature(
    backend: type[Sandbox], operation: str
) -> None:
    ours = getattr(backend, operation)
    assert _shape(ours) == _shape(getattr(Sandbox, operation))
    assert inspect.iscoroutinefunction(ours)


@pytest.mark.parametrize(
    ("module", "sdk", "extra"),
    [(e2b, "e2b_code_interpreter", "e2b"), (daytona, "daytona", "daytona")],
)
def test_a_missing_extra_is_one_error_that_names_it(
    monkeypatch: pytest.MonkeyPatch, module: object, sdk: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, sdk, None)
    with pytest.raises(BackendNotInstalledError) as info:
        module.import_sdk()  # type: ignore[attr-defined]
    assert isinstance(info.value, ImportError) and isinstance(info.value, SandboxError)
    assert info.value.extra == extra
    assert f"pip install 'prefect-sandbox[{extra}]'" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), copy.extra, str(copy)) == (BackendNotInstalledError, extra, str(info.value))


def test_a_block_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)
    with pytest.raises(BackendNotInstalledError, match=r"prefect-sandbox\[e2b\]"):
        E2BCredentials(api_key="e2b_x").get_client()
