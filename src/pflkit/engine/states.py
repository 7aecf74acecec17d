"""The client-state store: every client's private state (a personal model, a control variate,
an HPM, ...) with a bound on the memory it takes, so a run's memory is set by its cohort, not
by its population.

- A client that never took part costs nothing: its state is its seeded init
  (:func:`~pflkit.engine.clients.init_client`), computed when asked for and never written.
- Up to ``engine.state_memory`` bytes of states (counted as
  :func:`~pflkit.algorithms.base.nbytes` counts them) stay in memory, in an LRU cache. The
  least recently used ones beyond the bound go to disk; a state asked for again is read back.
- On disk each state version is one **safetensors** file, ``c<client>-v<version>.safetensors``,
  in the store's folder (``states/`` in the run folder). safetensors because it is the
  well-kept format for tensors on disk: no pickle (a file cannot run code when loaded), every
  dtype torch has (bfloat16 included), one small JSON header, and a loader that copies
  nothing it does not need; the state's structure (:func:`pflkit.plain.flatten`) goes into
  the header's metadata. One file per state version rather than an arena or LMDB: a write
  touches one client only, a file is never changed after it is written (a new version is a
  new file), and the store needs no compaction.
- Every write is atomic: the bytes go to a temporary file that is then renamed over the final
  name, so a process killed mid-write leaves the previous version intact (and a ``.tmp`` file
  that the next start removes). The store keeps each version's sha256, and a file whose bytes
  changed since it was written is refused with one sentence.
- Checkpoints are incremental: :meth:`ClientStates.commit` writes only the states that
  changed since the last one and returns the index (client -> version, digest), which the
  checkpoint records. Files named by the last checkpoint are kept until a newer checkpoint
  stands, so a resume always finds a consistent version of every state; a resume removes the
  files written after its checkpoint (:meth:`ClientStates.restore`).
- One store per folder: before it first writes or removes a file the store takes the
  folder's lock (``.lock``, :class:`~pflkit.engine.folder.FolderLock`: owner PID, host, start
  time), held until :meth:`ClientStates.close`; a second store on the same folder, in this
  process or another, is refused in one sentence, and a lock whose process is gone (killed)
  is taken over. Reading a finished run's states (``restore(..., prune=False)``) takes none.
- Nothing is silently reinitialised: a state file a checkpoint names that is missing is
  refused when the checkpoint is restored, one whose bytes changed when it is read.

A kill of the process is covered; a power cut is not (no fsync, as for checkpoints).
Results are bit-identical whatever ``engine.state_memory`` is: a state read back is the state
that was written, tensor for tensor (tests/test_conformance.py runs every algorithm both ways).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, cast

import torch

from pflkit.algorithms.base import State, nbytes
from pflkit.engine.folder import FolderLock, write_atomic
from pflkit.errors import PflkitError
from pflkit.plain import flatten, unflatten

SUFFIX = ".safetensors"
WRITE_FIX = (
    "free disk space (or raise engine.state_memory), then continue from the last checkpoint "
    "with pflkit run --resume"
)


def _encode(state: State) -> bytes:
    """A state as the bytes of one safetensors file (its structure in the header)."""
    from safetensors.torch import save

    schema, leaves = flatten(state)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storages already written
    for key, leaf in leaves.items():
        t = leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(leaf)
        t = t.contiguous()
        storage = t.untyped_storage().data_ptr()
        if t.numel() and storage in seen:  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(storage)
        tensors[key] = t
    return save(tensors, metadata={"schema": schema})


def _decode(data: bytes, device: torch.device | str) -> State:
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    schema = json.loads(data[8 : 8 + size])["__metadata__"]["schema"]
    return cast(State, unflatten(schema, load(data), device))  # _encode stored a State


class ClientStates(MutableMapping[int, State]):
    """The states of one run's clients (module docstring).

    As a mapping it holds the clients whose state is not their init (those that trained):
    ``store[cid]`` reads one back from disk when needed, ``store[cid] = state`` keeps a new
    one. :meth:`get_or_init` gives any client's state, its init for a client never stored.
    ``folder``: where states go when memory is full (created on the first write; None: a
    temporary folder, removed by :meth:`close`). ``init(cid)``: a client's first state.
    """

    def __init__(
        self,
        init: Callable[[int], State],
        memory: int,
        folder: Path | None = None,
        device: torch.device | str = "cpu",
    ):
        self.init = init
        self.memory = memory
        self.folder = folder
        self.device = device
        self._own_folder = folder is None
        # in memory: client -> (state, bytes, dirty); dirty: newer than its file (if any)
        self._cache: OrderedDict[int, tuple[State, int, bool]] = OrderedDict()
        self._used = 0
        self._files: dict[int, tuple[int, str]] = {}  # client -> (version, sha256) on disk
        self._committed: dict[int, tuple[int, str]] = {}  # the last checkpoint's index
        self._stored: set[int] = set()  # clients with a state that is not their init
        self._version = 0  # the last version number written
        self._lock: FolderLock | None = None  # the folder's, once this store writes to it
        self.reads = self.writes = 0  # disk traffic, for benchmarks and tests

    # -- the mapping ------------------------------------------------------------------------
    def __getitem__(self, cid: int) -> State:
        if cid not in self._stored:
            raise KeyError(cid)
        return self.get_or_init(cid)

    def __setitem__(self, cid: int, state: State) -> None:
        self._stored.add(cid)
        self._keep(cid, state, dirty=True)

    def __delitem__(self, cid: int) -> None:
        if cid not in self._stored:
            raise KeyError(cid)
        self._stored.discard(cid)
        if cid in self._cache:
            self._used -= self._cache.pop(cid)[1]
        old = self._files.pop(cid, None)
        if old is not None and self._committed.get(cid) != old:
            self._path(cid, old[0]).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._stored))

    def __len__(self) -> int:
        return len(self._stored)

    def get_or_init(self, cid: int) -> State:
        """Client ``cid``'s state: from memory, from disk, or (never stored) its init."""
        if cid in self._cache:
            self._cache.move_to_end(cid)
            return self._cache[cid][0]
        if cid in self._files:
            state = self._read(cid)
        else:
            with torch.random.fork_rng(devices=[]):  # init seeds torch: leave its stream alone
                state = self.init(cid)
        self._keep(cid, state, dirty=False)
        return state

    # -- memory and disk --------------------------------------------------------------------
    @property
    def bytes_in_memory(self) -> int:
        return self._used

    def _keep(self, cid: int, state: State, dirty: bool) -> None:
        if cid in self._cache:
            self._used -= self._cache.pop(cid)[1]
        size = nbytes(state)
        self._cache[cid] = (state, size, dirty)
        self._used += size
        while self._used > self.memory:
            old, (old_state, old_size, old_dirty) = self._cache.popitem(last=False)
            self._used -= old_size
            if old_dirty:
                self._write(old, old_state)

    def _dir(self) -> Path:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="pflkit-states-"))
        return self.folder

    def _take(self) -> None:
        """Hold the folder's lock (module docstring) before the first change to it."""
        if self._lock is None and not self._own_folder and self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = FolderLock(self.folder, "client-state folder")
            lock.__enter__()
            self._lock = lock

    def _path(self, cid: int, version: int) -> Path:
        return self._dir() / f"c{cid}-v{version}{SUFFIX}"

    def _write(self, cid: int, state: State) -> None:
        data = _encode(state)
        self._version += 1
        path = self._path(cid, self._version)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._take()
        write_atomic(path, data, WRITE_FIX)
        old = self._files.get(cid)
        if old is not None and self._committed.get(cid) != old:
            self._path(cid, old[0]).unlink(missing_ok=True)  # no checkpoint names it
        self._files[cid] = (self._version, hashlib.sha256(data).hexdigest())
        self.writes += 1

    def _read(self, cid: int) -> State:
        version, digest = self._files[cid]
        path = self._path(cid, version)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise PflkitError(
                f"cannot read client {cid}'s state '{path}' ({err.strerror}): the run's states "
                "folder was changed; restore it from a copy or start the run again"
            ) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise PflkitError(
                f"client {cid}'s state '{path}' fails its checksum (its bytes changed after "
                "pflkit wrote it): restore the file from a copy, or start the run again"
            )
        self.reads += 1
        return _decode(data, self.device)

    # -- checkpoints ------------------------------------------------------------------------
    def commit(self) -> dict[str, Any]:
        """Write every state that changed since the last commit; return the index a
        checkpoint records (plain data: client, version and digest lists)."""
        for cid, (state, size, dirty) in list(self._cache.items()):
            if dirty:
                self._write(cid, state)
                self._cache[cid] = (state, size, False)
        cids = sorted(self._files)
        return {
            "clients": cids,
            "versions": [self._files[c][0] for c in cids],
            "sha256": [self._files[c][1] for c in cids],
            "last_version": self._version,
        }

    def committed(self, index: dict[str, Any]) -> None:
        """The checkpoint holding ``index`` (what :meth:`commit` returned) now stands: the
        files only the previous one named are removed."""
        new = self._index(index)
        for cid, old in self._committed.items():
            if new.get(cid) != old and self._files.get(cid) != old:
                self._path(cid, old[0]).unlink(missing_ok=True)
        self._committed = new

    @staticmethod
    def _index(index: dict[str, Any]) -> dict[int, tuple[int, str]]:
        return {
            int(c): (int(v), str(h))
            for c, v, h in zip(index["clients"], index["versions"], index["sha256"], strict=True)
        }

    def restore(self, index: dict[str, Any] | None, prune: bool = True) -> None:
        """Go back to the version of every state a checkpoint's ``index`` names (None: no
        state stored, as at a run's start) and, with ``prune``, remove every other file of the
        folder: those written after that checkpoint, and temporary files of a write that was
        killed."""
        self._cache.clear()
        self._used = 0
        self._files = {} if index is None else self._index(index)
        self._committed = dict(self._files)
        self._stored = set(self._files)
        self._version = 0 if index is None else int(index["last_version"])
        if self.folder is None:
            return
        for cid, (version, _) in self._files.items():
            if not self._path(cid, version).exists():
                raise PflkitError(
                    f"the checkpoint names client {cid}'s state '{self._path(cid, version)}', "
                    "which is missing: restore the run's states folder from a copy, or start "
                    "the run again"
                )
        if prune and self.folder.is_dir():
            self._take()
            keep = {self._path(c, v).name for c, (v, _) in self._files.items()}
            for path in self.folder.iterdir():
                if path.name not in keep and path.name.endswith((SUFFIX, ".tmp")):
                    path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the folder's lock; remove the temporary folder, if this store made one."""
        if self._lock is not None:
            self._lock.__exit__()
            self._lock = None
        if self._own_folder and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


class StatesElsewhere(MutableMapping[int, State]):
    """The engine's side of client states that live where the clients run (a runner whose
    ``keeps_state`` is False: Flower's SuperNodes): it holds none, so a job carries none
    (:meth:`get_or_init` is None), a new state that a result brings (None) is dropped, and
    there is nothing to restore or to write."""

    bytes_in_memory = 0
    reads = writes = 0

    def __getitem__(self, cid: int) -> State:
        raise KeyError(cid)

    def __setitem__(self, cid: int, state: State) -> None:
        pass

    def __delitem__(self, cid: int) -> None:
        raise KeyError(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def get_or_init(self, cid: int) -> None:
        return None

    def restore(self, index: dict[str, Any] | None, prune: bool = True) -> None:
        pass

    def close(self) -> None:
        pass
