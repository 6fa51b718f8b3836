"""The "no loss" checker: is each sparse arm's final validation loss equivalent to dense?

Runs are paired by seed (same init, same data order), so the test is on the per-seed
differences d_s = arm_s - dense_s (or (arm_s - dense_s) / dense_s with ``--relative``).
Equivalence within a declared tolerance delta is shown with two one-sided tests (TOST) at
level alpha: both H0 "mean(d) <= -delta" and H0 "mean(d) >= +delta" must be rejected, which
is the same as the (1 - 2 alpha) confidence interval of mean(d) lying inside (-delta, +delta).

Verdicts per arm: ``equivalent`` (CI inside the bounds), ``worse`` (CI entirely above
+delta), ``better`` (CI entirely below -delta: no loss either), else ``inconclusive``
(fewer than 3 paired seeds, zero variance of the differences, or the CI crosses a bound).
A run that did not finish (any status other than "ok": failed, interrupted, or a summary
excluded as invalid because it is not the run its directory names, see
:mod:`sparsecomm.lab.results`) is never dropped silently: it is counted per arm with its
status and listed with its error; its seed has no pair. With no finished dense run
there is nothing to compare against: ``check`` says so, lists the failures, and exits 2.

Exit codes of ``sparsecomm check``: 0 every arm equivalent or better, 1 some arm worse,
2 usage error or unreadable run directory, 3 none worse but some inconclusive.

Needs no torch: reports are made anywhere. The statistics: :mod:`.tost` (the equivalence test)
and :mod:`.spread`; the verdicts of a run directory: :mod:`.verdicts`; the text: :mod:`.format`;
the command: :mod:`.cli`.

    sparsecomm check RUN_DIR [--tolerance D] [--relative] [--alpha A]
"""
from sparsecomm.lab.tolerance.cli import build_parser, main
from sparsecomm.lab.tolerance.format import EXIT_MEANING, format_report
from sparsecomm.lab.tolerance.spread import (NoiseFloor, OneSidedTest, RatioSpread, noise_floor, ratio_spread,
                                             steps_to_target_test)
from sparsecomm.lab.tolerance.tost import MIN_SEEDS, ZERO_VARIANCE_REASON, Equivalence, equivalence
from sparsecomm.lab.tolerance.verdicts import ArmResult, CheckReport, NoFinishedDense, check

__all__ = ["EXIT_MEANING", "MIN_SEEDS", "ZERO_VARIANCE_REASON", "ArmResult", "CheckReport", "Equivalence",
           "NoFinishedDense", "NoiseFloor", "OneSidedTest", "RatioSpread", "build_parser", "check", "equivalence",
           "format_report", "main", "noise_floor", "ratio_spread", "steps_to_target_test"]
