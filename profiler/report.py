"""Progress bars (rank 0, stderr) and the summary printed after a profile is written (the
tables are built in ``autoconf.output.tables``)."""

from __future__ import annotations

from autoconf.output.progress import Bars, wanted

__all__ = ["Bars", "wanted", "summary", "tables"]


def tables(profile):
    """The summary's renderables: layers, memory, GEMMs, links, collectives."""
    from autoconf.output.tables import profile_tables

    return profile_tables(profile)


def summary(profile, path: str) -> None:
    from autoconf.output.tables import profile_report, show

    show(profile_report(profile, path))
