"""Ranks fail together: when one rank raises from a collective call, every other rank raises too.

The module's collective calls (``forward``, ``step``, a backward through the forward's outputs,
``full_state_dict``, ``full_output``, ``full_grads``) are entered by every rank together
(``agree.all_entered``), so that a rank never blocks in a collective its peers will not join:
ranks that make different calls at the same point all raise ``CollectiveCallError`` at once, and
where some ranks do not come within ``entry_timeout_s``, those that came raise it. A rank that
raises it first calls ``fail_together``: it posts what failed under ``FAILED_KEY`` in
torch.distributed's store (the key-value store every backend starts from; the first failure
posted stays), sets the key every rank waiting in ``all_entered`` waits on to "failed", and
aborts this process's process groups. Then every other rank raises ``PeerFailedError``, naming the
rank and what it raised:

* a rank waiting in ``all_entered`` at once;
* a rank that comes to a collective call later, at that call, before it blocks;
* a rank blocked in a collective outside these calls (``clip_grad_norm_``, a checkpoint, the
  user's own) when the backend breaks that collective: gloo's when the failed rank's process
  exits; a collective the abort broke, inside ``run_section``, turns into ``PeerFailedError``.

A rank that raised (either error) has no process group left: a teardown ``barrier`` finds none
(``dist.is_initialized()`` is False) instead of hanging, and its later calls raise the failure
again. The store's server lives in rank 0's process; a process that aborts its groups keeps a
reference to its store, so that peers can still read the failure while it lives, and a rank that
timed out waits for its peers to read it (``ACK_WAIT_S`` at most) before it raises. Where the
server is gone (rank 0's process exited before a peer read it), the peer's error says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from autopar.errors import AutoparError, PeerFailedError

FAILED_KEY = "autopar/failed"  # the job's first failure: "rank R: <what it raised>"
ACKED_KEY = "autopar/failed/acked"  # set by the last peer to read the failure
WAITING_KEY = "autopar/waiting"  # /<rank>: the key that rank waits on in ``all_entered``, if any
ACK_WAIT_S = 5.0  # how long a failed rank waits for its peers to read its failure before it raises
_GONE = "rank 0's process exited (the process group's store, which it serves, is gone)"

_state = threading.local()  # depth: how many collective sections this thread is inside
_failure: list[str] = []  # the failure this process raised or learned of; its groups are aborted
_kept_store: list = []  # the store of the groups this process aborted (its server must outlive them)
_rank: list[int] = []  # this process's rank in the groups it aborted


def _store():
    if _kept_store:
        return _kept_store[0]
    return dist.distributed_c10d._get_default_store()


def _forget_if_new_world() -> None:
    """A process group initialized after this process aborted its own starts without a failure."""
    if (
        _kept_store
        and dist.is_initialized()
        and dist.distributed_c10d._get_default_store() is not _kept_store[0]
    ):
        _failure.clear()
        _kept_store.clear()
        _rank.clear()


def failed_here() -> bool:
    """Whether this process raised or learned of a failure (its groups are aborted)."""
    _forget_if_new_world()
    return bool(_failure)


def peer_failure() -> str | None:
    """The failure a rank of this job posted (``fail_together``), or None; where the store cannot
    be reached, that rank 0's process exited. A rank that reads a posted failure acknowledges it
    (the failed rank waits for that, ``ACK_WAIT_S`` at most, so that the store's server outlives
    the reading)."""
    if failed_here():
        return _failure[0]
    if not _kept_store and not dist.is_initialized():
        return None
    try:
        store = _store()
        if not store.check([FAILED_KEY]):
            return None
        failure = store.get(FAILED_KEY).decode()
        if store.add(f"{FAILED_KEY}/acks", 1) >= dist.get_world_size() - 1:
            store.set(ACKED_KEY, "1")
        _abort(failure)
        return failure
    except Exception:  # noqa: BLE001 - any error of the store's client: its server is gone
        return _GONE


def waiting_on(key: str) -> None:
    """Record that this rank waits for ``key`` to be set (``all_entered``): a rank that fails
    sets it to "failed", so that the wait ends at once."""
    _store().set(f"{WAITING_KEY}/{dist.get_rank()}", key)


def _abort(failure: str) -> None:
    """Remember ``failure`` and abort every process group of this process (keeping its store)."""
    if not _failure:
        _failure.append(failure)
    if not dist.is_initialized():
        return
    if not _kept_store:
        _kept_store.append(dist.distributed_c10d._get_default_store())
        _rank.append(dist.get_rank())
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - an abort that fails leaves nothing more to undo
        pass


def fail_together(message: str, wait_for_peers: bool = True) -> None:
    """Post ``message`` (what this rank is about to raise) as the job's failure, unless another
    rank posted one first; end the waits of the ranks waiting in ``all_entered``; abort this
    process's groups; and, with ``wait_for_peers`` (some ranks are elsewhere), wait
    ``ACK_WAIT_S`` at most for the other ranks to read the failure (module docstring)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    posted = f"rank {me}: {message}"
    store = dist.distributed_c10d._get_default_store()
    try:
        store.compare_set(FAILED_KEY, "", posted)
        posted = store.get(FAILED_KEY).decode()
        for r in range(world):
            if r != me and store.check([f"{WAITING_KEY}/{r}"]):
                store.compare_set(store.get(f"{WAITING_KEY}/{r}").decode(), "", "failed")
    except Exception:  # noqa: BLE001 - the store is gone: abort all the same
        _abort(posted)
        return
    _abort(posted)
    if not wait_for_peers:
        return
    try:
        store.wait([ACKED_KEY], timedelta(seconds=ACK_WAIT_S))
    except Exception:  # noqa: BLE001 - a peer that never reads it gets the store's error instead
        pass


def peer_failed(call: str, failure: str) -> PeerFailedError:
    """The error of a rank that stops in ``call`` because of ``failure`` (posted by a peer); this
    process's groups are aborted first."""
    _abort(failure)
    me = f"rank {_rank[0]}" if _rank else "this rank"
    return PeerFailedError(
        f"{call} stopped on {me}: a rank of the job failed in a collective call ({failure}); every rank stops "
        "with it, rather than wait in a collective that rank will never join: fix the call on the rank named (every "
        "rank must make the module's collective calls in the same order)"
    )


def section_depth() -> int:
    """How many collective sections (``agree.collective_section``) this thread is inside."""
    return getattr(_state, "depth", 0)


def run_section(call: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` as a collective section: where a peer's failure broke one of its
    collectives (the backend's error), ``PeerFailedError`` in its place (module docstring)."""
    depth = section_depth()
    _state.depth = depth + 1
    try:
        return fn(*args, **kwargs)
    except AutoparError:
        raise
    except RuntimeError as e:  # a collective a failed rank broke, or an error of its own
        failure = peer_failure() if depth == 0 and (_failure or dist.is_initialized()) else None
        if failure is None:
            raise
        raise peer_failed(call, failure) from e
    finally:
        _state.depth = depth
