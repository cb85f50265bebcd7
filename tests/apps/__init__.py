"""The Celery apps of the tests, run by real ``celery worker`` subprocesses
(``celery -A tests.apps.NAME``) and imported by the tests as producers."""
