r"""The price of parameter offload (``Offload.PARAMETERS``): host copies streamed block by block.

Under ``Offload.PARAMETERS`` (ZeRO-3 with FSDP2's ``CPUOffloadPolicy``, ``codegen/zero.py``) the
master shards, their gradients and the optimizer state live in host memory. Every gather of a
block first copies its shards from the host onto the device, in forward and again in backward,
and every gradient reduce-scatter copies the gradient shards back; the optimizer steps on the
host. ``passes/trade_terms.py:trade_terms`` prices the gathers themselves as ZeRO-3's; this module
prices what the host adds on top, per device and per step (``k`` micro-batches), in seconds:

* **parameters up** (host to device): block ``b``'s shard ``s_b`` bytes (the masters' dtype:
  FSDP2 copies the shard before it casts it for the gather) takes ``h_b = s_b / B + l`` over the
  host link (``ClusterSpec.host_link``, bandwidth ``B`` B/s, latency ``l`` s). The copy runs in
  the gather's stream, so a block's fetch is ``f_b = g_b + h_b`` (``g_b`` its all-gather) and the
  prefetch of the next block hides it behind this block's compute. Exposed in forward, blocks in
  order, ``c^f_b`` the forward compute of block ``b``::

      F(f) = f_0 + sum_b max(0, f_{b+1} - c^f_b)

  and in backward the same over the blocks in reverse, behind their backward compute ``c^b``.
  The price is ``k (F(f) - F(g) + B(f) - B(g))``: what the copies add to the exposure ZeRO-3
  already pays. The parameters outside the blocks (the root group: embeddings, head) are gathered
  exposed, in forward and backward: ``2 k h_root``.
* **gradients down** (device to host): block ``b``'s gradient shard ``e_b = s_b / B + l`` copies
  after its reduce-scatter, behind the backward of the block before it (the next one backward
  runs); the link is full-duplex (PCIe is), so the copies down do not wait for the prefetches
  up. Exposed: ``k (e_root + e_0 + sum_{b >= 1} max(0, e_b - c^b_{b-1}))``.
* **the optimizer step** on the host, at the host memory's bandwidth (``host_step``, computed by
  ``trade_terms`` as for ``Offload.OPTIMIZER``).

Device memory: the blocks in flight only, two blocks' gathered parameters (this one and the
prefetched one) and the largest block's whole gradient until its reduce-scatter: ZeRO-3's
transient (``trade_terms``), which on one device, where ZeRO-3 gathers nothing, this offload adds
itself (``in_flight_bytes``). Host memory: the masters, gradients and optimizer state, as
``Offload.OPTIMIZER`` holds them.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.hardware import LinkSpec


def exposed_chain(fetch: Sequence[float], compute: Sequence[float]) -> float:
    """Seconds of a chain of fetches not hidden behind compute: the first fetch whole, each next
    one behind the compute of the one before it, ``fetch[0] + sum_j max(0, fetch[j+1] - compute[j])``."""
    if not fetch:
        return 0.0
    return fetch[0] + sum(max(0.0, fetch[j + 1] - compute[j]) for j in range(len(fetch) - 1))


def copy_seconds(nbytes: float, link: LinkSpec) -> float:
    """One copy of ``nbytes`` over ``link`` (nothing to copy: no time)."""
    return nbytes / link.bandwidth + link.latency if nbytes > 0 else 0.0


def parameter_offload_seconds(
    gathers: Sequence[float],
    shards: Sequence[float],
    block_compute: Sequence[float],
    root_shard: float,
    link: LinkSpec,
    micro_batches: int,
) -> float:
    """Seconds the host copies add to a step (module docstring), per device. Per block, in forward
    order: ``gathers`` the seconds of its all-gather (0 on one device), ``shards`` its masters'
    shard in bytes (what is copied up, and its gradient down), ``block_compute`` its forward and
    backward compute in seconds (a third forward, two thirds backward, as ``trade_terms`` splits
    them); ``root_shard`` the bytes of the shards outside the blocks."""
    k = micro_batches
    up = [copy_seconds(s, link) for s in shards]
    fetch = [g + h for g, h in zip(gathers, up)]
    fwd_c = [c / 3 for c in block_compute]
    bwd_c = [2 * c / 3 for c in reversed(block_compute)]
    added = exposed_chain(fetch, fwd_c) - exposed_chain(gathers, fwd_c)
    added += exposed_chain(fetch[::-1], bwd_c) - exposed_chain(list(gathers)[::-1], bwd_c)
    # each block's gradient copy behind the backward of the block before it; block 0's exposed
    down = (up[0] if up else 0.0) + sum(
        max(0.0, up[b] - 2 * block_compute[b - 1] / 3) for b in range(1, len(up))
    )
    root = copy_seconds(root_shard, link)
    return k * (added + 2 * root + down + root)


def in_flight_bytes(
    gathered: Sequence[float], root_gathered: float, grads: Sequence[float], root_grads: float
) -> float:
    """Bytes the device holds for the blocks in flight: the two largest blocks' gathered
    parameters (this one and the prefetched one) and the root's, the largest block's whole
    gradient and the root's (ZeRO-3's transient, ``passes/trade_terms.py:trade_terms``)."""
    return sum(sorted(gathered)[-2:]) + root_gathered + max(grads, default=0.0) + root_grads
