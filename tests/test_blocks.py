"""Prefect's own standard checks over every block we ship."""

from __future__ import annotations

import inspect

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite

import prefect_sandbox
from prefect_sandbox.blocks import (
    DaytonaBackend,
    DaytonaCredentials,
    DockerBackend,
    E2BBackend,
    E2BCredentials,
    LocalKernelBackend,
)
from tests.conftest import python_stdout

SHIPPED = [
    LocalKernelBackend,
    E2BBackend,
    E2BCredentials,
    DaytonaBackend,
    DaytonaCredentials,
    DockerBackend,
]


def test_every_block_we_ship_is_checked_and_registrable() -> None:
    # As `prefect block register -m prefect_sandbox` finds them: inspect.getmembers.
    exported = {
        value
        for _, value in inspect.getmembers(prefect_sandbox)
        if isinstance(value, type) and issubclass(value, Block)
    }
    assert exported == set(SHIPPED)


class TestShippedBlocks(BlockStandardTestSuite):
    @pytest.fixture(params=SHIPPED, ids=lambda block: block.__name__)
    def block(self, request: pytest.FixtureRequest) -> type[Block]:
        return request.param  # type: ignore[no-any-return]

    def test_has_a_documentation_url(self, block: type[Block]) -> None:
        # The site is published nowhere yet (DOCS_URL is None): no "View Docs" link to a
        # placeholder (test_docs_site checks DOCS_URL and mkdocs.yml's site_url agree).
        assert block._documentation_url is None

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # No logo: a remote one is a broken image in a UI used offline; the UI draws its own.
        assert block._logo_url is None


@pytest.mark.parametrize(
    ("backend", "first"),
    [
        (LocalKernelBackend, ["isolation", "network"]),
        (DockerBackend, ["image"]),
        (E2BBackend, ["credentials", "template"]),
        (DaytonaBackend, ["credentials", "snapshot"]),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_a_backends_form_opens_on_its_own_fields_and_ends_on_the_shared_ones(
    backend: type[Block], first: list[str]
) -> None:
    schema = backend.model_json_schema()
    names = list(schema["properties"])
    assert names[: len(first)] == first
    shared = ["cell_timeout_s", "max_output_chars", "interrupt_grace_s", "max_live_sandboxes"]
    assert names[-4:] == shared
    assert [schema["properties"][name]["position"] for name in names] == list(range(len(names)))
    # Prefect's own additions are kept.
    assert schema["block_type_slug"] == backend.get_block_type_slug()
    assert "block_schema_references" in schema


def test_prefect_finds_the_blocks_when_it_loads_the_collection() -> None:
    """As Prefect's server, workers and block lookups by slug do: the ``prefect.collections``
    entry point imports the (otherwise lazy) package after Prefect."""
    code = (
        "import prefect\n"
        "from prefect.blocks.core import Block\n"
        "from prefect.plugins import load_prefect_collections\n"
        "from prefect.utilities.dispatch import lookup_type\n"
        "load_prefect_collections()\n"
        "print(lookup_type(Block, 'local-kernel-sandbox').__name__)\n"
    )
    assert python_stdout("-c", code).strip() == "LocalKernelBackend"
