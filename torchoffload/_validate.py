"""Checks of user-facing knobs, shared by every config and entry point: each names the
argument and says what it takes (`TypeError` for a wrong type, `ValueError` for a wrong value).
Strings that users pass for choices are parsed here, once, into enums."""

from __future__ import annotations

import enum
import os


def check_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, limit: str = ""
) -> None:
    """``limit``: what ``maximum`` is, for the message ("this host's physical memory")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        what = f" ({limit})" if limit else ""
        raise ValueError(f"{name} must be <= {maximum}{what}, got {value}")


def check_host_bytes(name: str, value: object, *, minimum: int = 0) -> None:
    """A byte count that host memory must hold: at most this host's physical memory."""
    check_int(
        name, value, minimum=minimum, maximum=physical_memory(),
        limit="this host's physical memory",
    )  # fmt: skip


def check_number(
    name: str, value: object, *, positive: bool = True, maximum: float | None = None
) -> None:
    """A finite real number, > 0 (``positive``) or >= 0, at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def check_callable(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__}")


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
