"""Today's date as a chat template writes it (Llama 3.1/3.2's "Today Date: 06 Dec 2026", through transformers'
`strftime_now`): it is part of every example, so it enters the cache key (another day's build is another entry),
and a resumed run records it (training.resume.run_identity) so that a resume on another day reuses its own data."""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

CLOCK_FUNCTIONS = ("strftime_now",)  # the date/time functions transformers' template environment offers
_DATED: dict[str, dict[str, str]] = {}  # cache key → the dates its build's template wrote (this process's keys)
_SAID: set[str] = set()


def template_dates(template: Optional[str]) -> Optional[dict[str, str]]:
    """What the template writes of the clock today, by format ("%d %b %Y" → "06 Dec 2026"; "" → the date, for a
    format the template computes); None where it calls no clock function (or cannot be parsed: rendering fails
    alike and says so)."""
    if not isinstance(template, str) or not any(name in template for name in CLOCK_FUNCTIONS):
        return None
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(template)
        tree = compiled.environment.parse(template)
    except Exception:  # noqa: BLE001 (a template that does not compile: rendering it says why)
        return None
    calls = [call for call in tree.find_all(nodes.Call)
             if isinstance(call.node, nodes.Name) and call.node.name in CLOCK_FUNCTIONS]
    if not calls:
        return None
    dates = {}
    for call in calls:  # asked of the template's own clock, as its rendering asks it
        clock = compiled.environment.globals[call.node.name]
        constant = len(call.args) == 1 and isinstance(call.args[0], nodes.Const) and isinstance(call.args[0].value, str)
        dates[call.args[0].value if constant else ""] = clock(call.args[0].value if constant else "%Y-%m-%d")
    if template not in _SAID:
        _SAID.add(template)
        logger.info("the chat template writes today's date into every example (%s): the tokenization cache key "
                    "includes it, so a build on another day is another entry", ", ".join(sorted(set(dates.values()))))
    return dates


def remember(key: str, dates: Optional[dict[str, str]]) -> None:
    if dates:
        _DATED[key] = dates


def dates_of(key: str) -> Optional[dict[str, str]]:
    """The dates the template wrote into the build of this key (this process made it), for the run's record."""
    return _DATED.get(key)


def recorded_dates(resuming: Optional[dict[str, Any]]) -> tuple[Optional[str], Optional[dict[str, str]]]:
    """The cache key and template dates a checkpoint recorded (None, None: none, or not dated)."""
    identity = (resuming or {}).get("identity") or {}
    return identity.get("dataset_cache_key"), identity.get("template_date")
