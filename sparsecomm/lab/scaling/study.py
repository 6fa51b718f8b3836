"""A scaling study's plan: the base experiment, the world sizes it runs at, what stays fixed
as they grow (the per-rank or the global batch), the other arms' step budget and the links
the time to target is modelled on; every argument checked and every point's experiment built
before anything runs."""
import argparse
import math
import os
from dataclasses import dataclass

from sparsecomm.lab.compare import (
    LOCAL_RANKS_PER_CORE,
    check_has_compared_arm,
    check_launcher_possible,
    check_link_possible,
    check_local_world_size,
    local_world_size_limit,
    parse_arms,
    with_job_overrides,
)
from sparsecomm.lab.experiment.config import hsdp_shape_of
from sparsecomm.lab.experiment.config_source import experiment_from_source
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.links.spec import parse_link

BATCH_MODES = ("per-rank", "global")

BOTH_BATCH_MODES = "both"
"""--batch both: one study per mode of :data:`BATCH_MODES`, in one command (the smallest p's
experiment is the same in both, so it runs once)."""


@dataclass(frozen=True)
class Study:
    """The base experiment and what varies: the world sizes, and how the batch follows them."""

    config: object  # ExperimentConfig: arms, seeds, steps, step_budget, link, ...; world size set per point
    world_sizes: tuple[int, ...]  # sorted, distinct
    batch: str = "per-rank"
    model_links: tuple[str, ...] = ()  # links the time to target is modelled on (names with a rate)

    @property
    def budget_suffix(self) -> str:
        """``-budget<X>x`` where the other arms train step_budget x dense's steps, else "": runs of
        another budget are other runs, and judging them needs their own directory."""
        budget = self.config.step_budget
        return "" if budget == 1 else f"-budget{budget:g}x"

    def batch_size(self, p: int) -> int:
        """Samples per rank at world size ``p``."""
        if self.batch == "per-rank":
            return self.config.batch_size
        return self.config.batch_size * self.world_sizes[0] // p

    def point_config(self, p: int):
        """The experiment at world size ``p``: ``<name>-p<p>``, ``-b<batch>`` where the per-rank batch differs."""
        batch = self.batch_size(p)
        name = (f"{self.config.name}-p{p}" + ("" if batch == self.config.batch_size else f"-b{batch}")
                + self.budget_suffix)
        return self.config.with_overrides(world_size=p, batch_size=batch, name=name)

    @property
    def stem(self) -> str:
        """Name of the study's plots folder: ``<experiment>-scaling`` (``<experiment>-global<N>-scaling``
        with --batch global; ``-budget<X>x`` before ``-scaling`` with a step budget)."""
        batch = f"-global{self.config.batch_size * self.world_sizes[0]}" if self.batch == "global" else ""
        return f"{self.config.name}{batch}{self.budget_suffix}-scaling"

    def describe_batch(self) -> str:
        sizes = ", ".join(f"{self.batch_size(p) * p} at p={p}" if self.batch == "per-rank" else
                          f"{self.batch_size(p)} at p={p}" for p in self.world_sizes)
        if self.batch == "per-rank":
            return (f"fixed: the per-rank batch, {self.config.batch_size} samples (--batch per-rank, weak scaling; "
                    f"the global batch grows with p: {sizes})")
        return (f"fixed: the global batch, {self.config.batch_size * self.world_sizes[0]} samples, the smallest p's "
                f"(--batch global; per rank: {sizes})")


def check_world_sizes(sizes: list[int]) -> tuple[int, ...]:
    """--world-sizes: at least two distinct integers in [2, the local limit]; returned sorted."""
    limit = local_world_size_limit()
    accepted = (f"an integer in [2, {limit}] (at most {LOCAL_RANKS_PER_CORE} ranks per CPU core x "
                f"{os.cpu_count() or 1} cores: every rank is started on this machine)")
    if len(sizes) < 2:
        raise ValueError(f"argument --world-sizes: give at least two world sizes to scale across, each {accepted}; "
                         f"got {sizes}")
    bad = [p for p in sizes if not 2 <= p <= limit]
    if bad:
        raise ValueError(f"argument --world-sizes: each must be {accepted}; got {bad[0]}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"argument --world-sizes: must be distinct, got {sizes}")
    return tuple(sorted(sizes))


def check_no_fixed_shape(parallelism: str, given_as: str, world_sizes: tuple[int, ...]) -> None:
    """Refuse ``hsdp:RxS``, which runs on R x S ranks exactly, so no study across world sizes
    can use it (said here, before the shape meets a world size it does not fit)."""
    shape = hsdp_shape_of(parallelism)
    if shape is not None:
        replicas, shards = shape
        raise ValueError(f"{given_as}: {parallelism} runs on exactly {replicas} x {shards} = {replicas * shards} "
                         f"ranks, but a scaling study runs every arm at each of --world-sizes "
                         f"{' '.join(map(str, world_sizes))}: it needs parallelism \"ddp\" (the default). To measure "
                         "HSDP at several sizes, run `sparsecomm compare --parallelism hsdp:RxS --world-size N` once "
                         "per shape (R x S = N)")


def check_global_batch(config, world_sizes: tuple[int, ...], given: str = "global") -> None:
    """--batch global (or both, ``given``): the smallest p's global batch must split evenly over every p."""
    total = config.batch_size * world_sizes[0]
    uneven = [p for p in world_sizes if total % p]
    if uneven:
        raise ValueError(f"argument --batch {given}: the global batch of the smallest world size, {total} samples "
                         f"(batch_size {config.batch_size} x {world_sizes[0]} ranks), does not split evenly over "
                         f"{', '.join(map(str, uneven))} ranks (--world-sizes {' '.join(map(str, world_sizes))}); "
                         f"choose world sizes that divide {total}, or --batch per-rank")


def check_step_budget(budget) -> float | None:
    """--step-budget: a finite number >= 1 (None: the experiment's, 1 unless its config says)."""
    if budget is not None and not (math.isfinite(budget) and budget >= 1):
        raise ValueError(f"argument --step-budget: must be a finite number >= 1 (the other arms' steps as a "
                         f"multiple of dense's; 1, the default, trains every arm as long as dense), got {budget:g}")
    return budget


def check_model_links(links: list[str] | None, run_link: str) -> tuple[str, ...]:
    """--model-link: link names with a rate (and optionally a latency); by default the study's
    own --link when that is emulated (a rate), else none."""
    if not links:
        return () if parse_link(run_link).rate_bits_per_s is None else (run_link,)
    names = []
    for text in links:
        try:
            link = parse_link(text)
        except ValueError as error:
            raise ValueError(f"argument --model-link: {error}") from None
        if link.rate_bits_per_s is None:
            raise ValueError("argument --model-link: must be a rate to model the communication on, such as 100mbit, "
                             f"1gbit or 10gbit@50us (loopback has no known rate), got {text!r}")
        names.append(link.name)
    if len(set(names)) != len(names):
        raise ValueError(f"argument --model-link: must be distinct, got {' '.join(names)}")
    return tuple(names)


def batch_modes(batch: str) -> tuple[str, ...]:
    """The modes --batch asks for: one, or both of :data:`BATCH_MODES`."""
    return BATCH_MODES if batch == BOTH_BATCH_MODES else (batch,)


def make_studies(args: argparse.Namespace) -> list[Study]:
    """One study per batch mode --batch asks for, every argument checked first (as :func:`make_study`)."""
    return [make_study(args, batch) for batch in batch_modes(args.batch)]


def make_study(args: argparse.Namespace, batch: str | None = None) -> Study:
    """Every argument checked (ValueError naming it), every point's config built: nothing runs.
    ``batch``: the mode of this study (default: --batch, which must then be one mode)."""
    batch = batch or args.batch
    if batch not in BATCH_MODES:  # "both" is two studies: make_studies
        raise ValueError(f"make_study: batch must be one of {BATCH_MODES} (make_studies makes one study per mode of "
                         f"--batch {BOTH_BATCH_MODES}), got {batch!r}")
    world_sizes = check_world_sizes(args.world_sizes)
    budget = check_step_budget(getattr(args, "step_budget", None))
    base = experiment_from_source(args)
    check_no_fixed_shape(args.parallelism or base.parallelism, "argument --parallelism" if args.parallelism else
                         f"experiment {base.name}: parallelism", world_sizes)
    arms, definitions = parse_arms(args.arms) if args.arms else (None, None)
    if arms is not None and DENSE_ARM not in arms:
        arms = (DENSE_ARM, *arms)  # the baseline every arm is judged against, at every p
    config = with_job_overrides(base, args, arms=arms, definitions=definitions)
    if budget is not None:
        config = config.with_overrides(step_budget=float(budget))
    check_has_compared_arm(config, args)
    if config.link != "loopback":  # its own experiments and study beside the loopback ones
        config = config.with_overrides(name=f"{config.name}-{config.link}")
    if batch == "global":
        check_global_batch(config, world_sizes, args.batch)
    study = Study(config, world_sizes, batch, check_model_links(getattr(args, "model_link", None), config.link))
    for p in world_sizes:
        try:
            check_local_world_size(study.point_config(p))
        except ValueError as error:
            raise ValueError(f"argument --world-sizes: at world size {p} ({study.batch_size(p)} samples per rank): "
                             f"{error}") from None
    check_link_possible(config)
    check_launcher_possible(config)
    return study
