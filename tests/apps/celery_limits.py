"""The limits that the tasks of :mod:`tests.apps.celery_app` name, as lines of a limits
file's ``limits:`` section (a worker refuses to start when one is missing), for the
system tests that run that app. Doubled braces: the tests ``str.format`` their files."""

LIMITS = """\
  upstream: {{algorithm: gcra, rate: 20/s, burst: 1}}
  slow: {{algorithm: gcra, rate: 4/s, burst: 1}}
  tokens: {{rate: 10000/d, key: "{{tenant}}", cost: estimate, on_error: refund}}
  deadline: {{algorithm: gcra, rate: 1/h, burst: 1, max_wait: 2s}}
  dlq: {{algorithm: gcra, rate: 1/h, burst: 1, max_wait: 1s, on_timeout: "dead_letter:dead"}}
  parked: {{algorithm: gcra, rate: 3/s, burst: 1}}
  live: {{algorithm: gcra, rate: 10/s, burst: 1}}
  strict: {{algorithm: gcra, rate: 10/s, burst: 1}}
  held: {{algorithm: gcra, rate: 4/s, burst: 1}}
  fair: {{algorithm: gcra, rate: 10/s, burst: 1, key: "{{tenant}}", fair: true}}
"""
