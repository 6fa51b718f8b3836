"""The window between two reads of a source's counters: how much each grew since the last read.

A source (a :class:`~sparsecomm.TopKState`, a :class:`~sparsecomm.SparseDeltaAverager`)
keeps running totals since its construction or its last ``load_state_dict``. A window is the
difference of two snapshots of them. A load replaces the totals with the checkpoint's, which
no difference of snapshots can see through (the totals after the load and a few steps mix
the checkpoint's history with the steps since); so each snapshot carries a ``marker``, an
object the source replaces exactly when it replaces its totals, and a window whose two ends
have different markers is unknown (None), not a wrong number.
"""


class CounterWindow:
    """The growth of named counters between consecutive :meth:`advance` calls."""

    def __init__(self, marker, counters: dict):
        self._marker, self._since = marker, dict(counters)

    def advance(self, marker, counters: dict) -> dict | None:
        """Each counter's growth since the previous call (or construction); None when the
        source replaced its counters in between (``marker`` is another object). The window
        restarts here either way."""
        previous_marker, since = self._marker, self._since
        self._marker, self._since = marker, dict(counters)
        if marker is not previous_marker:
            return None
        return {name: value - since[name] for name, value in counters.items()}
