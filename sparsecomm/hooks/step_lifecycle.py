"""Where the hook is in its step: which buckets are in flight, whether the last step is
settled, whether the ranks' settings were compared; and the dense-fallback warning's record."""


class StepLifecycle:
    __slots__ = ("pending", "open", "settled", "agreed", "bypass", "fallback_bound", "warned_all_dense")

    def __init__(self):
        self.pending = 0  # collectives issued whose result has not been delivered yet
        self.open = False  # a bucket of the current step arrived and its last one has not
        self.settled = True  # the last finished step's overflow, unused parameters, scale are dealt with
        self.agreed = False  # the ranks' settings were compared (first hook call)
        self.bypass = False  # True while rebuild_buckets() runs a pass that must change nothing
        self.fallback_bound = None  # largest density that would have gone sparse this step, for the warning
        self.warned_all_dense = False  # DenseFallbackWarning was given

    def note_fallback(self, density_bound: float) -> None:
        """A bucket went dense because its wire would send more: remember the density that would not."""
        self.fallback_bound = max(density_bound, self.fallback_bound or 0.0)

    def forget(self) -> None:
        """Memories were replaced: nothing of the last step is left to settle; compare the ranks again."""
        self.settled, self.open, self.agreed = True, False, False
