"""A griffe extension for the API reference: the docstrings are written with reST roles
(``:class:`Limit```, ``:mod:`throttle.celery```) and literal-block markers (``Worker
side::``); mkdocstrings renders Markdown, so each role becomes inline code and ``::`` a
colon before the rendering."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|mod|func|meth|data|attr|exc|obj):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(r"`\1`", obj.docstring.value)
            obj.docstring.value = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)
