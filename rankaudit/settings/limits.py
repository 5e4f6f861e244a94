"""How large a number the user gives may be: counts, seconds and GiB within what rankaudit's arithmetic holds."""

from __future__ import annotations

# Counts (a batch size, local samples, epochs, steps): exact as floats, and far above any real round.
MAX_COUNT = 2**53
# --timeout: about four months; --memory-limit: a pebibyte. Above them a limit would be no limit.
MAX_SECONDS = 1e7
MAX_GIB = 2.0**20


def shown(number) -> str:
    """A number as a one-line message may quote it: a 400-digit integer is said to be one, not printed."""
    text = str(number)
    return f"a {len(text.lstrip('-'))}-digit number" if isinstance(number, int) and len(text) > 24 else text


def too_large(number) -> bool:
    """An integer above MAX_COUNT, or a float that is not finite or above it."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    return not -MAX_COUNT <= number <= MAX_COUNT
