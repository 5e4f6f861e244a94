"""How large a number the user gives may be: counts, seconds and GiB within what rankaudit's arithmetic holds."""

from __future__ import annotations

# Counts (a batch size, local samples, epochs, steps): exact as floats, and far above any real round.
MAX_COUNT = 2**53
# --timeout: about four months; --memory-limit: a pebibyte. Above them a limit would be no limit.
MAX_SECONDS = 1e7
MAX_GIB = 2.0**20
# A PSNR target in dB: far outside this the noise it asks for is no float (10^(PSNR/20) overflows at 6,000 dB).
PSNR_TARGET_DB = (-100.0, 200.0)
# A DP noise multiplier the accountant's arithmetic holds: its loss grid divides by 2σ² and squares 12σ, which
# underflow to 0 or overflow past these (a σ of 1e-300 or 1e300 is no mechanism a float describes).
NOISE_MULTIPLIER = (1e-100, 1e100)
# The model worker's limits, which a parse of an app's configuration runs under too.
DEFAULT_TIMEOUT = 300.0  # seconds for each of the model's import, build and trace


def default_memory_limit() -> float:
    """GiB: 8, or half the machine's memory where that is less."""
    import os

    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return 8.0
    return min(8.0, physical / 2)


def shown(number) -> str:
    """A number as a one-line message may quote it: a 400-digit integer is said to be one, not printed."""
    text = str(number)
    return f"a {len(text.lstrip('-'))}-digit number" if isinstance(number, int) and len(text) > 24 else text


def too_large(number) -> bool:
    """An integer above MAX_COUNT, or a float that is not finite or above it."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    return not -MAX_COUNT <= number <= MAX_COUNT
