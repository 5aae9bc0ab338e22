"""The one error an adapter load answers with."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be loaded, in ember's own words: no library's text and no host path
    but the one its caller gave, so a server may hand it to a client as it is. Any other exception
    from a load is logged and answered in general terms."""
