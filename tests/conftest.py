"""Shared pytest configuration: hypothesis profiles ("ci" by default, "dev" for quick local runs), early jobs
(see ``_early.py``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import gradsync
from _early import EarlyJob, EarlyRunner

settings.register_profile("ci", deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=10,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def _early_jobs(request, tmp_path_factory):
    """Run the early jobs of the selected tests marked ``early_job``, in test order; kill leftovers at the end.

    ``session.items`` holds the tests left after ``-m``/``-k`` deselection, so ``make test`` (``-m "not slow"``)
    starts no early job of a ``slow`` test and ``make test-slow`` none of a fast one.
    """
    names = []
    for item in request.session.items:
        for marker in item.iter_markers("early_job"):
            if marker.args[0] not in names:
                names.append(marker.args[0])
    runner = EarlyRunner([EarlyJob(name, tmp_path_factory.mktemp(f"early-{name}")) for name in names])
    yield runner.jobs
    runner.stop()


@pytest.fixture
def early(request, _early_jobs) -> EarlyJob:
    """The early job named by this test's ``early_job`` marker."""
    return _early_jobs[request.node.get_closest_marker("early_job").args[0]]


@pytest.fixture
def single_process(monkeypatch):
    """A one-process gradsync group (no launcher variables), shut down afterwards."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    gradsync.init(backend="gloo", timeout=30)
    try:
        yield
    finally:
        gradsync.shutdown()
