"""The offline test-image recipe: mirror discovery, tags, and a kernel answering in the image."""

from __future__ import annotations

import subprocess
import sys
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


# A session with the plugin whose daemon and build are stand-ins: the build takes 3 s.
_SLOW_BUILD_CONFTEST = """
import time
from pathlib import Path

import prefect_sandbox.testing.docker_fixtures as plugin

class Daemon:
    client = None
    def __enter__(self):
        return self
    def __exit__(self, *exc_info):
        pass

def build(client):
    time.sleep(3)
    Path("built").write_text(str(time.time()))
    return "kernel:test"

plugin.DockerDaemon = Daemon
plugin.build_test_image = build
"""

_PLAIN_MODULE = """
import time
from pathlib import Path

def test_a_plain_test_runs_during_the_build():
    Path("plain").write_text(str(time.time()))
"""

_DOCKER_MODULE = """
import time
from pathlib import Path

import pytest

def test_a_plain_test_beside_a_docker_test_waits_for_the_build():
    Path("beside").write_text(str(time.time()))

@pytest.mark.docker
@pytest.mark.timeout(1)
def test_a_docker_test_waits_for_the_build_outside_its_timeout(docker_image):
    assert docker_image == "kernel:test"
"""


def test_the_image_builds_while_other_modules_run_and_a_docker_module_waits_outside_timeouts(
    tmp_path: Path,
) -> None:
    """A module with a Docker test waits before its first test (its shared sandboxes of other
    backends would sit idle through the build, and expire); the others run meanwhile."""
    (tmp_path / "conftest.py").write_text(_SLOW_BUILD_CONFTEST)
    (tmp_path / "test_plain.py").write_text(_PLAIN_MODULE)
    (tmp_path / "test_with_docker.py").write_text(_DOCKER_MODULE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "prefect_sandbox.testing.docker_fixtures",
         "-p", "no:cacheprovider", "-q", "test_plain.py", "test_with_docker.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    built = float((tmp_path / "built").read_text())
    assert float((tmp_path / "plain").read_text()) < built
    assert float((tmp_path / "beside").read_text()) > built
