"""The limits file of the tenants scenario (tests/apps/tenants_app.py), shared by
tests/system/test_tenants.py and bench/tenants.py: a per-tenant GCRA limit and a shared one
at 99 % of the mock API's 20/s."""

from __future__ import annotations

LIMITS = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
  park_lead: 1s
limits:
  tenant: {algorithm: gcra, rate: 15/s, burst: 1, key: "{tenant}"}
  shared: {algorithm: gcra, rate: 19.8/s, burst: 1}
"""
