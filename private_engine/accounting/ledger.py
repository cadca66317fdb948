"""A durable record of the private steps released, written to disk before each release.

An accountant's history lives in memory and reaches disk only with a checkpoint; a run killed
after its last checkpoint may have released steps that no checkpoint records. The adversary of DP
training sees every released iterate, so a run resumed from that checkpoint must count them. A
:class:`StepLedger` is an append-only text file that holds

* a header line (JSON): the format, a random run identifier (public: it depends on no data) and
  the accountant history ``[(σ, q, steps), …]`` spent before the ledger was opened;
* one line per private step, ``[k, σ, q]`` (JSON; ``k`` is the step's number), written and
  ``fsync``-ed by :meth:`StepLedger.record` *before* the step's noisy update is applied.

Every value in it is public (privacy parameters and step counts, as in the accountant). The history
it gives (:func:`read_ledger`) is the header's plus one ``(σ, q)`` step per line: every step whose
update may have been released. A step refused after its line was written (an error in the
optimizer's own step) still counts: the ledger errs towards spending more, never less.

A crash in the middle of :meth:`StepLedger.record` can leave a last line without its newline: its
step was never released (the update waits for the ``fsync``), so that line is ignored on reading
and cut off when the ledger is opened again. Several processes appending to one ledger (two runs
resumed from one checkpoint) each add their own lines, and every line counts.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..foundation.files import atomic_create

#: the header's format tag and version
LEDGER_FORMAT = "private_engine.ledger"
LEDGER_VERSION = 1

History = List[Tuple[float, float, int]]


@dataclass
class LedgerContents:
    """What a ledger file records: its run identifier and the history of the steps it counts."""

    run: str
    history: History

    @property
    def steps(self) -> int:
        """The number of steps the history counts."""
        return sum(n for _, _, n in self.history)


def read_ledger(path) -> LedgerContents:
    """The run identifier and the spent history recorded in the ledger at ``path``: the header's
    history followed by one ``(σ, q)`` step per complete line (consecutive equal ``(σ, q)`` merged
    into one entry, as an accountant's history). A last line without its newline (a write cut by a
    crash, before its release) is ignored; anything else that does not parse raises
    ``ValueError``, as does a missing or foreign header. Changes nothing."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    complete = lines[:-1]  # the part after the last newline is empty or a torn write
    if not complete:
        raise ValueError(f"{os.fspath(path)!r} is not a private_engine step ledger (no header).")
    try:
        header = json.loads(complete[0])
    except ValueError:
        header = None
    if (not isinstance(header, dict) or header.get("format") != LEDGER_FORMAT
            or not isinstance(header.get("run"), str)):
        raise ValueError(f"{os.fspath(path)!r} is not a private_engine step ledger.")
    if header.get("version") != LEDGER_VERSION:
        raise ValueError(f"step ledger version {header.get('version')!r} is not supported "
                         f"(this private_engine reads version {LEDGER_VERSION}).")
    history = [_entry(e, path) for e in header.get("history", [])]
    for number, line in enumerate(complete[1:], start=2):
        try:
            _, sigma, q = json.loads(line)
            step = (_number(sigma), _number(q), 1)
        except (ValueError, TypeError) as e:
            raise ValueError(f"step ledger {os.fspath(path)!r}: line {number} is not a step record "
                             f"({line[:80]!r}); the ledger is damaged.") from e
        history = merge_history(history, [step])
    return LedgerContents(str(header["run"]), history)


def merge_history(history: Sequence[Tuple[float, float, int]],
                  more: Sequence[Tuple[float, float, int]]) -> History:
    """``history`` followed by ``more``, consecutive entries of equal ``(σ, q)`` merged (the form
    of an Opacus accountant's history)."""
    out: History = [(float(s), float(q), int(n)) for s, q, n in history]
    for s, q, n in more:
        if out and out[-1][0] == s and out[-1][1] == q:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + int(n))
        else:
            out.append((float(s), float(q), int(n)))
    return out


def is_prefix(history: Sequence[Tuple[float, float, int]],
              longer: Sequence[Tuple[float, float, int]]) -> bool:
    """Whether the sequence of steps ``history`` describes (each ``(σ, q)`` repeated ``n`` times)
    begins the sequence ``longer`` describes."""
    a = [(float(s), float(q), int(n)) for s, q, n in history if n]
    b = [(float(s), float(q), int(n)) for s, q, n in longer if n]
    j, left = 0, b[0][2] if b else 0
    for s, q, n in a:
        while n:
            if j >= len(b) or (b[j][0], b[j][1]) != (s, q):
                return False
            used = min(n, left)
            n, left = n - used, left - used
            if left == 0:
                j += 1
                left = b[j][2] if j < len(b) else 0
    return True


#: the ledger of a checkpoint at ``path`` lives at ``path + LEDGER_SUFFIX``
LEDGER_SUFFIX = ".ledger"


class StepLedger:
    """An open step ledger: :meth:`record` appends one step, durably, before its release.

    Create one with :meth:`create` (a new file, its header holding the history spent so far) or
    :meth:`open` (an existing file, appended to). ``writer=False`` gives a ledger that reads but
    never writes (data-parallel ranks other than the one that records)."""

    def __init__(self, path: str, run: str, history: History, fd: Optional[int]):
        self.path = path
        #: the run identifier in the header (random, public)
        self.run = run
        #: the spent history as this process knows it: the file's at opening plus its own records
        self.history: History = history
        self._fd = fd

    @property
    def writer(self) -> bool:
        """Whether :meth:`record` writes to the file (False: a reading rank)."""
        return self._fd is not None

    @classmethod
    def beside(cls, checkpoint_path, history: Sequence[Tuple[float, float, int]] = ()
               ) -> "StepLedger":
        """The ledger of a run whose first checkpoint goes to ``checkpoint_path``: a new file at
        ``checkpoint_path + LEDGER_SUFFIX``, refused with a ``ValueError`` that says what to do
        when one exists there (another run's)."""
        path = os.fspath(checkpoint_path) + LEDGER_SUFFIX
        if os.path.exists(path):
            raise ValueError(
                f"{path!r} exists: the step ledger of another run saved to this path. Resume "
                "that run with load_checkpoint (which continues its ledger), or save to another "
                "path (or remove both files if that run's releases no longer matter).")
        return cls.create(path, history)

    @classmethod
    def create(cls, path, history: Sequence[Tuple[float, float, int]] = (),
               writer: bool = True) -> "StepLedger":
        """A new ledger at ``path`` whose header records ``history`` (the steps spent before it)
        and a fresh random run identifier; refuses (``FileExistsError``) to replace an existing
        file. The header is written atomically
        (:func:`private_engine.foundation.files.atomic_create`: temporary file, ``fsync``, hard
        link to ``path``, directory ``fsync``)."""
        path = os.path.abspath(os.fspath(path))
        history = merge_history([], history)
        run = secrets.token_hex(16)
        header = {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "run": run,
                  "history": [list(e) for e in history]}
        # fails if path exists: never replaces another run's ledger
        atomic_create((json.dumps(header) + "\n").encode(), path, mode=0o644)
        return cls.open(path, writer=writer)

    @classmethod
    def open(cls, path, writer: bool = True) -> "StepLedger":
        """The ledger at ``path``, to append to (``writer``) or only to read. A torn last line (a
        record cut by a crash before its release) is cut off before appending."""
        path = os.path.abspath(os.fspath(path))
        contents = read_ledger(path)
        fd = None
        if writer:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            size = os.fstat(fd).st_size
            with open(path, "rb") as f:
                data = f.read()
            end = data.rfind(b"\n") + 1
            if end != size:
                os.ftruncate(fd, end)
                os.fsync(fd)
        return cls(path, contents.run, contents.history, fd)

    @property
    def steps(self) -> int:
        """The number of steps :attr:`history` counts."""
        return sum(n for _, _, n in self.history)

    def record(self, noise_multiplier: float, sample_rate: float) -> None:
        """Count one step of ``(σ, q)``: append its line and ``fsync`` it before returning (a
        reading ledger only counts it in memory). Call it before the step's update is applied."""
        sigma, q = float(noise_multiplier), float(sample_rate)
        if self._fd is not None:
            line = json.dumps([self.steps + 1, sigma, q]) + "\n"
            os.write(self._fd, line.encode())
            os.fsync(self._fd)
        self.history = merge_history(self.history, [(sigma, q, 1)])

    def close(self) -> None:
        """Close the file (records after this raise)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def _number(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"not a number: {x!r}")
    return float(x)


def _entry(e, path) -> Tuple[float, float, int]:
    try:
        s, q, n = e
        return _number(s), _number(q), int(n)
    except (ValueError, TypeError) as err:
        raise ValueError(f"step ledger {os.fspath(path)!r}: its header's history is damaged "
                         f"({e!r}).") from err


__all__ = ["LEDGER_FORMAT", "LEDGER_VERSION", "LedgerContents", "StepLedger", "is_prefix",
           "merge_history", "read_ledger"]
