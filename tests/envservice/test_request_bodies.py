"""The env server's request bodies: the query names they take."""

from __future__ import annotations

import pydantic
import pytest

from turnrl.envservice.protocol import QUERIES
from turnrl.envservice.request_bodies import QueryItem, ResetItem, StepItem


def test_the_server_takes_exactly_the_queries_the_client_knows():
    """The request schema reads its query names off the contract: each is taken, anything else refused."""
    for name in QUERIES:
        assert QueryItem(session="a", queries=[name]).queries == [name]
        assert ResetItem(session="a", queries=[name]).queries == [name]
    for bad in ("close", "canonical_action", "reset", "nonsense"):
        with pytest.raises(pydantic.ValidationError, match="unknown query"):
            StepItem(session="a", action="x", queries=[bad])
