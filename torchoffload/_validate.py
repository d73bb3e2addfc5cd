"""Checks of user-facing knobs, shared by every config and entry point: each names the
argument and says what it takes (`TypeError` for a wrong type, `ValueError` for a wrong value).
Strings that users pass for choices are parsed here, once, into enums."""

from __future__ import annotations

import enum
import os


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def physical_memory() -> int:
    """Bytes of physical memory on this host (64 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 64 << 30


class OnExhausted(str, enum.Enum):
    """What a pinned pool does when a request does not fit under its capacity."""

    FALLBACK = "fallback"  # allocate the block outside the slabs (one warning per pool)
    RAISE = "raise"  # raise PoolExhaustedError

    @classmethod
    def parse(cls, value: object, name: str = "on_pool_exhausted") -> OnExhausted:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be 'fallback' or 'raise', got {value!r}") from None
