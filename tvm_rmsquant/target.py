"""The GPU targets a bundle can hold machine code for: the one home of every per-arch fact.

Imports neither TVM nor torch, so that the loader, the build's lowering workers and the
CLI all ask it. One record per target; a bundle carries SASS for each target of its
build's list in every kernel library (one nvcc call, one ``-gencode`` per target), from
one generated CUDA source.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU target: what nvcc, TVM, the schedule rules, the benchmark and the loader need of it."""

    name: str
    #: The compute capability its machine code runs on: "a" (arch-specific) SASS runs on that one only.
    capability: Tuple[int, int]
    #: nvcc's flag that embeds this target's SASS.
    gencode: str
    #: TVM's CUDA target ``arch``.
    tvm_arch: str
    #: Resident threads per SM (``min_blocks_per_sm`` is refused past it).
    threads_per_sm: int
    #: L2 bytes that the benchmark's rotating input copies must exceed.
    l2_bytes: int


SM_90A = Target(
    name="sm_90a",
    capability=(9, 0),
    gencode="-gencode=arch=compute_90a,code=sm_90a",
    tvm_arch="sm_90",
    threads_per_sm=2048,
    l2_bytes=60 * 2**20,  # the H200's, per the project notes (docs/perf.md)
)
SM_100A = Target(
    name="sm_100a",
    capability=(10, 0),
    gencode="-gencode=arch=compute_100a,code=sm_100a",
    tvm_arch="sm_100",
    # Unknown here (no Blackwell GPU measured): sm_90's value, as the brief's rule for an unknown fact.
    threads_per_sm=SM_90A.threads_per_sm,
    # Unknown here (no Blackwell GPU measured): sm_90's value; the benchmark rotates 3x this.
    l2_bytes=SM_90A.l2_bytes,
)

TARGETS = {target.name: target for target in (SM_90A, SM_100A)}
#: What ``build`` makes without ``--arch``: Hopper, and Blackwell for the ``deepgemm_sm100`` consumer.
DEFAULT_ARCHS = ("sm_90a", "sm_100a")


def targets(archs: Sequence[str]) -> Tuple[Target, ...]:
    """The records of ``archs``; ValueError naming the value and the valid archs."""
    unknown = ",".join(arch for arch in archs if arch not in TARGETS)
    if unknown or not archs:
        raise ValueError(f"arch={unknown!r} is not a known target; the archs are {', '.join(TARGETS)}")
    return tuple(TARGETS[arch] for arch in archs)


def parse_archs(text: str) -> Tuple[str, ...]:
    """``sm_90a,sm_100a`` -> ('sm_90a', 'sm_100a'), each once, in the order given."""
    archs = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    targets(archs)
    return archs


def for_capability(capability: Sequence[int], archs: Sequence[str]) -> Target:
    """The target among ``archs`` whose machine code runs on a device of ``capability``;
    ValueError naming the device's capability and the archs there are."""
    for target in targets(archs):
        if tuple(capability) == target.capability:
            return target
    have = ", ".join(f"{t.name} (compute capability {t.capability[0]}.{t.capability[1]})" for t in targets(archs))
    raise ValueError(f"the device has compute capability {capability[0]}.{capability[1]}; the bundle has code for {have}")


def scheduling_target(archs: Sequence[str]) -> Target:
    """The target that schedule rules are given for a library built for ``archs``: the oldest,
    which TVM generates the one source for (``lower.cuda_target``). Its facts must hold on the
    newer archs too, since the same kernels run there: ValueError naming the arch where one does not."""
    chosen = targets(archs)
    oldest = min(chosen, key=lambda target: target.capability)
    for target in chosen:
        if target.threads_per_sm < oldest.threads_per_sm:
            raise ValueError(
                f"arch={target.name} has {target.threads_per_sm} threads per SM, fewer than the {oldest.threads_per_sm} "
                f"of {oldest.name} whose schedules it would run; build it separately"
            )
    return oldest
