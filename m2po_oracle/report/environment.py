"""The one Jinja setup of the package's HTML pages (compare, audit and bench)."""

from __future__ import annotations

import functools

import jinja2

from m2po_oracle.report.values import fmt, fmt_short


@functools.cache
def environment(*, strict: bool = True) -> jinja2.Environment:
    """The templates' environment, autoescaping everything (every string may come from the
    implementation under test). ``strict``: a name the view lacks raises, so that a typo in a
    template fails the tests instead of rendering blank; the audit page renders reports of
    older or partial audits, whose missing keys print empty (``strict=False``)."""
    # Built lazily so importing the module stays cheap for CLI paths that never render.
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("m2po_oracle.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined if strict else jinja2.Undefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = fmt
    env.filters["short"] = fmt_short
    return env
