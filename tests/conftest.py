"""Hypothesis profiles: CI runs a fixed, reproducible set of examples (a red CI always reproduces
locally with CI=true); developers get fresh random examples on every run to keep exploring."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
