"""Tests against a real redis-server (or TLS, Sentinel, Cluster), from this process."""
