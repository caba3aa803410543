"""Which rank of a launched job this process is: read from the variables the launcher set.

Launchers and their variables (docs/distributed.md "What the launchers set"):

* torchrun and ``accelerate launch`` (torch elastic, ``env://``): ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (accelerate adds ``ACCELERATE_*`` variables).
* Intel MPI and MPICH (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
* Open MPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE``.

:func:`parse_launch` is pure (it reads a mapping); :func:`xpukit.detect` passes it the process's
environment through :mod:`xpukit._environ`. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from xpukit.errors import InvalidRequestError

__all__ = ["LAUNCH_VARIABLES", "LaunchFacts", "parse_launch"]

# (launcher, rank, local rank, world size, local world size), in the order they are tried: torch's own
# variables first (torchrun sets them even when started under mpirun).
_FAMILIES: tuple[tuple[str, str, str, str, str], ...] = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    (
        "open-mpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("intel-mpi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
)
# Variables that tell which program started the job, beside the rank variables.
_MARKERS = (
    "TORCHELASTIC_RUN_ID",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_DYNAMO_BACKEND",
)
LAUNCH_VARIABLES: tuple[str, ...] = tuple(dict.fromkeys(v for f in _FAMILIES for v in f[1:])) + _MARKERS


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchFacts:
    """This process's place in a launched job.

    Attributes:
        launcher: ``torchrun``, ``accelerate``, ``open-mpi``, ``intel-mpi`` (also MPICH), ``env`` (the
            torch variables set by hand) or ``assumed`` (``xpukit plan --rank``).
        rank: the global rank.
        local_rank: the rank on this node; it names this rank's device (``xpu:<local_rank>``).
        world_size: processes in the job.
        local_world_size: processes on this node, where the launcher says.
        variables: the variables these facts were read from, as set.
        notes: what had to be assumed (e.g. no local rank given).
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None = None
    variables: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def distributed(self) -> bool:
        """Whether the job has more than one process."""
        return self.world_size > 1

    def describe(self) -> str:
        """One line, e.g. ``rank 1 of 2 (local rank 1 of 2), torchrun``."""
        local = f" of {self.local_world_size}" if self.local_world_size is not None else ""
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}{local}), {self.launcher}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "launcher": self.launcher,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "variables": dict(self.variables),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchFacts:
        """Rebuild what :meth:`to_dict` wrote; unknown keys are ignored (a newer report)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["variables"] = tuple(dict(values.get("variables") or {}).items())
        values["notes"] = tuple(values.get("notes") or ())
        return cls(**values)

    @classmethod
    def assumed(cls, rank: int, world_size: int, local_rank: int | None = None) -> LaunchFacts:
        """Facts for planning as rank ``rank`` of ``world_size`` on one node (``xpukit plan --rank``).

        Raises:
            InvalidRequestError: a rank outside ``0 .. world_size-1``.
        """
        facts = cls(
            launcher="assumed",
            rank=rank,
            local_rank=rank if local_rank is None else local_rank,
            world_size=world_size,
            local_world_size=world_size,
        )
        _check(facts, f"rank {rank}/{world_size}")
        return facts


def parse_launch(environ: Mapping[str, str]) -> LaunchFacts | None:
    """The launch facts in ``environ``, or ``None`` when no launcher's rank variables are set.

    Args:
        environ: the environment to read (pure: nothing else is read).

    Returns:
        The facts of the first launcher family whose rank and world size are both set.

    Raises:
        InvalidRequestError: a variable that is not a number, or a rank outside the world size.
    """
    for launcher, rank_var, local_var, world_var, local_world_var in _FAMILIES:
        if rank_var not in environ and local_var not in environ:
            continue
        if world_var not in environ:
            continue
        read = tuple(
            (v, environ[v]) for v in (rank_var, local_var, world_var, local_world_var) if v in environ
        )
        values = {name: _int(name, value) for name, value in read}
        notes: list[str] = []
        rank = values.get(rank_var, values.get(local_var, 0))
        if local_var in values:
            local_rank = values[local_var]
        else:
            local_rank = rank
            notes.append(f"{local_var} is not set: the local rank is taken to be the rank ({rank})")
        if launcher == "torchrun":
            if any(k.startswith("ACCELERATE_") for k in environ):
                launcher = "accelerate"
            elif "TORCHELASTIC_RUN_ID" not in environ:
                launcher = "env"
        facts = LaunchFacts(
            launcher=launcher,
            rank=rank,
            local_rank=local_rank,
            world_size=values[world_var],
            local_world_size=values.get(local_world_var),
            variables=read,
            notes=tuple(notes),
        )
        _check(facts, ", ".join(f"{k}={v}" for k, v in read))
        return facts
    return None


def _int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidRequestError(
            f"{name}={value!r} is not a number; a launcher sets it to this process's rank or the job's "
            f"size. Fix: unset {name} or start the job with torchrun / accelerate launch / mpirun."
        ) from None


def _check(facts: LaunchFacts, where: str) -> None:
    problems = []
    if facts.world_size < 1:
        problems.append("the world size must be at least 1")
    if not 0 <= facts.rank < max(facts.world_size, 1):
        problems.append(f"rank {facts.rank} is outside 0..{facts.world_size - 1}")
    if facts.local_rank < 0 or (
        facts.local_world_size is not None and facts.local_rank >= facts.local_world_size
    ):
        problems.append(
            f"local rank {facts.local_rank} is outside the node's {facts.local_world_size} processes"
        )
    if problems:
        raise InvalidRequestError(
            f"The launch variables ({where}) contradict each other: {'; '.join(problems)}. "
            "Fix: start the job "
            "with torchrun / accelerate launch / mpirun instead of setting them by hand."
        )
