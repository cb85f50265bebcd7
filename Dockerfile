# The image of the Python services of docker-compose.yml: the throttle package, the demo's
# workers/ and configs/, Celery, Flower and matplotlib, all at the versions of
# constraints.txt. Every service runs it with its own command (workers/stack.py).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package first: this layer is rebuilt only when the library or its pins change.
COPY pyproject.toml constraints.txt README.md ./
COPY throttle/ throttle/
COPY lua/ lua/
RUN pip install -c constraints.txt '.[metrics]' flower matplotlib

# The demo's apps and limits, run from /app (python -m workers.…, celery -A workers.…).
COPY workers/ workers/
COPY configs/ configs/
