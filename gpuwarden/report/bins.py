"""One rule for the time axis of every chart: a bar per UTC day, a bar per week past
`WEEKLY_OVER_DAYS` (a bar per day of a long history is unreadable, and megabytes of SVG)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

DAY = 86_400
WEEKLY_OVER_DAYS = 92


def bin_days(ndays: int) -> int:
    return 7 if ndays > WEEKLY_OVER_DAYS else 1


def day_label(n: int) -> str:
    """The UTC day number ``n`` as YYYY-MM-DD."""
    return datetime.fromtimestamp(n * DAY, UTC).strftime("%Y-%m-%d")


def unit(days: int) -> str:
    return "day" if days == 1 else "week"


def tick_labels(labels: Sequence[str]) -> tuple[list[str], str]:
    """(tick labels, what they are): month-day with the year in the axis label, or the whole
    date when the span crosses a year."""
    years = sorted({s[:4] for s in labels})
    if len(years) > 1:
        return list(labels), "year-month-day"
    return [s[5:] for s in labels], f"month-day, {years[0]}" if years else "month-day"
