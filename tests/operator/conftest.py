"""Fixtures for the operator's unit tests."""

from __future__ import annotations

import pytest

from tests.operator.fakes import FakeKube


@pytest.fixture
def fake_kube() -> FakeKube:
    return FakeKube()
