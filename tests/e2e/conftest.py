"""Fixtures the e2e tier shares with the service tier: a real server on port 0 and its client."""

from tests.service.conftest import connect, start_kv_server  # noqa: F401 (fixtures, found by pytest here)
