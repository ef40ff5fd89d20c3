"""One rule for the time axis of every chart: a bar per UTC day, a bar per week past
`WEEKLY_OVER_DAYS`, and past `MAX_BINS` weeks a bar per as many weeks as keep the bars at
most `MAX_BINS` (a bar per day of a long history is unreadable, and megabytes of SVG; a
record dated decades off made thousands of bars)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

DAY = 86_400
WEEKLY_OVER_DAYS = 92
MAX_BINS = 400


def bin_days(ndays: int) -> int:
    if ndays <= WEEKLY_OVER_DAYS:
        return 1
    weeks = -(-ndays // 7)
    return 7 * max(1, -(-weeks // MAX_BINS))


def day_label(n: int) -> str:
    """The UTC day number ``n`` as YYYY-MM-DD."""
    return datetime.fromtimestamp(n * DAY, UTC).strftime("%Y-%m-%d")


def unit(days: int) -> str:
    return "day" if days == 1 else "week" if days == 7 else f"{days // 7} weeks"


def tick_labels(labels: Sequence[str]) -> tuple[list[str], str]:
    """(tick labels, what they are): month-day with the year in the axis label, or the whole
    date when the span crosses a year."""
    years = sorted({s[:4] for s in labels})
    if len(years) > 1:
        return list(labels), "year-month-day"
    return [s[5:] for s in labels], f"month-day, {years[0]}" if years else "month-day"
