"""The env server every test module of this folder may share: one per module, served over loopback HTTP."""

from __future__ import annotations

import pytest

from tests.envservice.env_helpers import env_server


@pytest.fixture(scope="module")
def server():
    with env_server() as url:
        yield url
