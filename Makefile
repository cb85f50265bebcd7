# The two commands of the README: `make demo` and `make test`. Each sets itself up,
# idempotently, on a fresh machine: a virtualenv with pinned dependencies, and redis-server
# (plus faketime, for the clock-skew test, openssl, for the TLS test's certificates,
# python3-venv, and docker-compose, whose `config` checks docker-compose.yml without a
# Docker engine) from apt-get when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps test-deps test test-fast lint typecheck pytest docs docs-check demo demo-core screenshot screenshot-web bench bench-celery bench-cluster soak clean bench-skew bench-overhead bench-tenants bench-adaptive bench-restart bench-strict bench-fair bench-lua bench-gate bench-providers bench-plans bench-kill bench-rates bench-refund bench-celery-suite

setup: system-deps $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v faketime >/dev/null || missing="$$missing faketime"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

lint: setup
	$(VENV)/bin/ruff check throttle tests bench workers docs/_hooks
	$(VENV)/bin/ruff format --check throttle tests bench workers docs/_hooks

typecheck: setup
	$(VENV)/bin/mypy

# Celery's own sdist at the pinned version: bench/celery_suite.py runs a selection
# of its integration tests (t/integration) under a binding limit.
CELERY_VERSION := $(shell sed -n 's/^celery==//p' constraints.txt)
CELERY_SDIST := $(VENV)/celery-$(CELERY_VERSION).tar.gz

$(CELERY_SDIST): constraints.txt | $(STAMP)
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(VENV) celery==$(CELERY_VERSION)

# Two processes, each taking whole test files (a module's servers and workers stay in one
# process): most of a test's time is waiting for rates and fleets, not CPU.
PYTEST_PROCESSES ?= 2

pytest: setup test-deps
	$(PY) -m pytest -n $(PYTEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

test: test-deps lint typecheck docs-check pytest

# What only `make test` needs from apt-get, when missing: Debian's chromium and
# chromium-driver (tests/system/test_web.py drives the limits page in a real browser) and
# prometheus, whose package carries promtool (tests/integration/test_alert_rules.py).
test-deps:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The documentation site (mkdocs.yml, docs/): `make docs` builds it into site/; `make test`
# builds it with --strict, so a broken link, a missing page or a bad reference fails. The
# build needs no network (the theme's web fonts are off).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build

docs-check: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The inner loop: tests/unit only (no server, no lint, no mypy; a few seconds). `make test`
# runs everything: tests/unit, tests/integration (real redis-server) and tests/system
# (celery workers, Flower, kills, the demo stack).
test-fast: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

demo: setup
	$(PY) -m workers.celery_demo

# docs/flower.png: Flower's tasks page while the demo stack throttles, in headless Chromium
# (installed from apt-get when missing; only this target needs it).
screenshot: setup
	@command -v chromium >/dev/null || { echo "installing: chromium"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }
	$(PY) -m workers.screenshot

# docs/web.png: the limits page (`celery throttle web`) of the same demo stack.
screenshot-web: setup
	@command -v chromium >/dev/null || { echo "installing: chromium"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }
	$(PY) -m workers.screenshot --page web

# The limiter alone, without Celery: processes sharing one limit in Redis.
demo-core: setup
	$(PY) -m workers.fleet_demo

bench: setup
	$(PY) -m bench.core

# Where Redis spends an acquire's server time: the pieces of a function, measured in Redis.
bench-lua: setup
	$(PY) -m bench.lua_costs

# A Celery fleet against a 20/s burst-1 API: ours vs Celery's rate_limit vs a naive retry.
bench-celery: setup
	$(PY) -m bench.celery_fleet

# The limiter's Redis losing its data mid-run, 20 runs (issue 17).
# Celery's own integration tests (a selection) under a binding limit: pytest's verdict, with
# the two errback tests that read counters with a timeout of 0 named as the limit's doing.
bench-celery-suite: setup $(CELERY_SDIST)
	$(PY) -m pytest bench/celery_suite.py -p no:cacheprovider

bench-restart: setup
	$(PY) -m bench.restart $(RESTART_ARGS)

# A strict (burst-1) API with the upstream hook, the call-time spacing guard off vs on.
bench-strict: setup
	$(PY) -m bench.strict $(STRICT_ARGS)

# 100,000 tasks through two workers at the limit's rate: lost, twice, Redis keys and memory
# back to baseline, worker memory flat. Several minutes: not part of `make test`.
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)

# Acquisitions per second on private Redis Clusters of 1, 2 and 3 masters: their capacity
# with redis-benchmark (redis-tools, installed with redis-server), the masters' CPU per
# acquisition and a projection from it, and a fleet of Python processes. About 2 minutes.
bench-cluster: setup
	$(PY) -m bench.cluster

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site

# Two workers whose wall clocks are +S and -S off (an LD_PRELOAD shim built with gcc), on a
# Redis and a RabbitMQ broker: the share of the API's rate kept, ours beside BEFORE (a git
# revision, default the code before the one-clock change). About 15 minutes.
BEFORE ?= e1bee06
bench-skew: setup
	$(PY) -m bench.skew --before $(BEFORE) $(SKEW_ARGS)

# One tenant floods, another trickles, under a per-tenant and a shared limit: the trickle's
# wait and the shared limit's use, and the single-limit baseline, ours beside BEFORE_TENANTS
# (the code before shared limits were taken when due). About 4 minutes.
BEFORE_TENANTS ?= f0eea23
bench-tenants: setup
	$(PY) -m bench.tenants --before $(BEFORE_TENANTS)

# A worker SIGKILLed while it holds waiting throttled tasks, every pool x broker (Redis,
# RabbitMQ classic and quorum queues) x acks_late: tasks lost and run twice, publishes per
# task. The RabbitMQ cases need the service at 127.0.0.1:5672 (a private vhost, deleted).
bench-kill: setup
	$(PY) -m bench.kill_matrix $(KILL_ARGS)

# What throttling costs a worker per task: one `celery worker -c 4`, 2,000 no-op tasks per
# block, plain vs throttled (limits that never bind), medians of interleaved rounds, script
# calls per task from INFO commandstats; OVERHEAD_ARGS="--before REV" runs an older
# revision's worker beside this one. A few minutes.
bench-overhead: setup
	$(PY) -m bench.overhead $(OVERHEAD_ARGS)

# The throttler's own Python per task, in one process (Celery's tracer, no pool): CPU per
# task with Redis and with a canned reply; GATE_ARGS="--before REV" beside an older
# revision, "--profile one_limit" for cProfile's table. About a minute.
bench-gate: setup
	$(PY) -m bench.gate_cpu $(GATE_ARGS)

# Fair share: three tenants flood one shared limit through 2 workers x 4 children against
# the mock API: first come first served, fair, fair with weights. About two minutes.
bench-fair: setup
	$(PY) -m bench.fair $(FAIR_ARGS)

# A fleet calling mock LLM providers through the real openai and anthropic SDKs: steady, and
# the provider halving its token limit (docs/benchmarks/providers.md). About 5 minutes.
bench-providers: setup
	$(PY) -m bench.providers $(PROVIDERS_ARGS)

# High rates: 100/s and 500/s limits against an API with 100 ms of latency, each pool
# (gevent -c 100, threads -c 50, prefork -c 4) beside its own unthrottled ceiling in the
# same invocation: the share of the limit, refusals, tasks twice, broker publishes per
# task (docs/benchmarks/rates.md). About 5 minutes on a quiet host.
bench-rates: setup
	$(PY) -m bench.rates $(RATES_ARGS)

# Cost and refund: a token limit (2,000/s, burst 4,000) whose tasks reserve about twice
# what they report, against a mock provider charging the usage; beside tasks that reserve
# exactly their usage (docs/benchmarks/refund.md). About 3 minutes on a quiet host.
bench-refund: setup
	$(PY) -m bench.refund $(REFUND_ARGS)

# Three tenants on three plans through 2 workers x 4 children against a mock API enforcing
# each plan; an override mid-run; the same fleet in shadow mode beside an unthrottled
# control (docs/benchmarks/plans.md). About 3 minutes.
bench-plans: setup
	$(PY) -m bench.plans $(PLANS_ARGS)

# An upstream that answers 429 with only Retry-After and changes its limit silently (20 ->
# 10/s, 10 -> 20/s), and a strict burst-1 API at 99/98/95 %: ours (adaptive limits, the
# proportional answer) beside BEFORE_ADAPTIVE (a git revision, default the code before
# them), real worker fleets. About 12 minutes.
BEFORE_ADAPTIVE ?= f0eea23
bench-adaptive: setup
	$(PY) -m bench.adaptive --before $(BEFORE_ADAPTIVE) $(ADAPTIVE_ARGS)
