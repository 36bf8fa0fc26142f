"""The offline test-image recipe: mirror discovery, tags, and a kernel answering in the image."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest

from prefect_sandbox.testing.docker import (
    IMAGE_REPOSITORY,
    IMAGE_REQUIREMENTS,
    debian_mirror,
    kernel_image_tag,
)


def test_debian_mirror_reads_apt_sources_in_both_formats(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n"
    )
    one_line = tmp_path / "sources.list"
    one_line.write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64] https://other.example/debian bookworm main\n"
    )
    assert debian_mirror([tmp_path / "missing", deb822]) == "http://mirror.example/debian"
    assert debian_mirror([one_line]) == "https://other.example/debian"
    assert debian_mirror([]) == "http://deb.debian.org/debian"


def test_kernel_image_tag_names_the_recipe() -> None:
    tag = kernel_image_tag()
    assert tag.startswith(f"{IMAGE_REPOSITORY}:")
    assert tag == kernel_image_tag(IMAGE_REQUIREMENTS)
    assert tag != kernel_image_tag([*IMAGE_REQUIREMENTS, "scipy>=1.13"])


@pytest.mark.docker
def test_image_has_the_kernel_and_the_examples_libraries(docker_image: str) -> None:
    output = docker.from_env().containers.run(
        docker_image,
        ["python", "-c", "import ipykernel, pandas, matplotlib, statsmodels; print('ok')"],
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": ""},
        environment={"HOME": "/tmp"},
        remove=True,
    )
    assert output == b"ok\n"
