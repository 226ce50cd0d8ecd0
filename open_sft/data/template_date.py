"""Today's date as a chat template writes it (Llama 3.1/3.2's "Today Date: 06 Dec 2026", through transformers'
`strftime_now`): it is part of every example, so it enters the cache key (another day's build is another entry),
and a resumed run records it (training.resume.run_identity) so that a resume on another day reuses its own data.

The clock is read once per run (`read_clock`, at the data phase) and a build renders under that moment
(`clock_at`): a build that crosses midnight writes one date, the one its key holds."""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)

CLOCK_FUNCTIONS = ("strftime_now",)  # the date/time functions transformers' template environment offers
_DATED: dict[str, dict[str, str]] = {}  # cache key → the dates its build's template wrote (this process's keys)
_SAID: set[str] = set()


def _clock_calls(template: Optional[str]) -> Optional[tuple[Any, list]]:
    """The template's compiled environment and its calls of a clock function; None where it calls none (or cannot
    be parsed: rendering fails alike and says so)."""
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
    return (compiled.environment, calls) if calls else None


def read_clock(template: Optional[str]) -> Optional[datetime.datetime]:
    """The moment the template's clock gives now (asked of its own `strftime_now`, as its rendering asks it); None
    where the template calls no clock. Read once per run: the builds render under it (`clock_at`)."""
    found = _clock_calls(template)
    if found is None:
        return None
    now = found[0].globals["strftime_now"]("%Y-%m-%dT%H:%M:%S.%f")
    return datetime.datetime.strptime(now, "%Y-%m-%dT%H:%M:%S.%f")


@contextlib.contextmanager
def clock_at(moment: Optional[datetime.datetime]) -> Iterator[None]:
    """Every render inside (and in render workers forked inside) reads `moment` from transformers' `strftime_now`,
    not the time it renders at; None: the live clock."""
    if moment is None:
        yield
        return
    from transformers.utils import chat_template_utils

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return moment

    live = chat_template_utils.datetime
    chat_template_utils.datetime = Frozen
    try:
        yield
    finally:
        chat_template_utils.datetime = live


def template_dates(template: Optional[str], moment: Optional[datetime.datetime] = None) -> Optional[dict[str, str]]:
    """What the template writes of the clock at `moment` (read now where not given), by format ("%d %b %Y" →
    "06 Dec 2026"; "" → the date, for a format the template computes); None where it calls no clock function."""
    found = _clock_calls(template)
    if found is None:
        return None
    from jinja2 import nodes

    environment, calls = found
    dates = {}
    with clock_at(moment):
        for call in calls:  # asked of the template's own clock, as its rendering asks it
            clock = environment.globals[call.node.name]
            constant = len(call.args) == 1 and isinstance(call.args[0], nodes.Const) \
                and isinstance(call.args[0].value, str)
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
