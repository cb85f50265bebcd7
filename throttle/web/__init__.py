"""The limits page: every limit of a fleet, live, in a browser (``celery throttle web``).

:class:`~throttle.web.snapshot.Sampler` reads what ``celery throttle status`` reads, plus
the tasks waiting and parked per limit and key and the admitted rate for a chart, every
few seconds in one thread; :class:`~throttle.web.server.LimitsPage` serves the page and
that data (standard library ``http.server``, no CDN, no JavaScript framework), and, only
with a control token, pause and resume. See docs/web.md.

Why a command of its own and not a tab in Flower: Flower 2.2 has no plugin API. Its
``flower`` command builds its tornado application from the fixed list
``flower.urls.handlers`` and starts it, with no hook in between; a page inside Flower means
editing that list before the command runs, patching its internals.
"""

from throttle.web.server import LimitsPage
from throttle.web.snapshot import Sampler

__all__ = ["LimitsPage", "Sampler"]
