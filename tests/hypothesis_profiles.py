"""Hypothesis settings profiles for sgl's property tests.

"ci" (the default): derandomized, so CI runs are reproducible. "long" (select with
HYPOTHESIS_PROFILE=long): random, many more and longer runs, for soak testing.
This module registers the profiles and loads none globally, so importing it does not
change other tests' settings: tests pass `PROFILE` explicitly, and a conftest that
wants a session-wide default calls `settings.load_profile(PROFILE_NAME)`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=5000,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PROFILE_NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci")
PROFILE = settings.get_profile(PROFILE_NAME)
