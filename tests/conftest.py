"""Shared pytest configuration: hypothesis profiles ("ci" by default, "dev" for quick local runs)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=10,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
