"""Temperature readings from a weather station: parse, clean and summarise them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reading:
    station: str
    hour: int
    celsius: float


def parse_line(line: str) -> Reading | None:
    """One reading from a line 'station,hour,celsius'; None for a line that is not one."""
    parts = line.strip().split(",")
    if len(parts) != 3:
        return None
    station, hour, celsius = parts
    try:
        return Reading(station, int(hour), float(celsius))
    except ValueError:
        return None


def clean(readings: list[Reading]) -> list[Reading]:
    """Readings within the station's physical range, one per hour."""
    seen = set()
    out = []
    for r in readings:
        if not -60.0 <= r.celsius <= 60.0 or r.hour in seen:
            continue
        seen.add(r.hour)
        out.append(r)
    return out


def daily_summary(readings: list[Reading]) -> dict[str, float]:
    """The lowest, highest and mean temperature of a day's readings."""
    values = [r.celsius for r in readings]
    return {"low": min(values), "high": max(values), "mean": sum(values) / len(values)}
