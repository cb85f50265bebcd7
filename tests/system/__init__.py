"""Fleets of processes: real ``celery worker`` subprocesses, Flower, kills and outages,
the demo stack."""
