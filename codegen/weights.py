"""Where each rank's pieces of the model's state come from: no rank ever holds the whole model.

``build_parallel_module`` asks a ``StateLoader`` for this rank's piece of every parameter and buffer
the traced graph reads, under the plan's placement (``piece_slices``: the rows and columns of the
whole tensor one rank keeps, ``torch.chunk``'s pieces, as ``DTensor``'s ``Shard`` cuts). The pieces
come from, in this order:

1. ``weights=`` of ``autoparallelize``:

   * a path: a Hugging Face checkpoint folder (``save_pretrained``'s ``model.safetensors``, or the
     shards named by ``model.safetensors.index.json``) or one ``.safetensors`` file. Each rank
     reads only its slice of each tensor (``safetensors``' ``get_slice``: the file is mapped, the
     slice copied out), cast to the model's dtype;
   * ``Rank0Weights(state_dict)``: a state dict that rank 0 alone holds (the other ranks pass
     ``Rank0Weights(None)``): each tensor, in turn, is broadcast from rank 0 and sliced, so a rank
     holds its pieces plus one whole tensor at a time;

   a tensor is found under any of its names (tied weights: a checkpoint keeps one of them);
2. the model's own tensors, where they are real (a model built on every rank);
3. the model's own initializers, for a model on the meta device (``Initializer``).

``StateLoader.load`` makes a group of tensors at a time: all of them for plans without ZeRO-2/3;
under FSDP2 one group (a block, then the rest) just before FSDP2 shards it (``codegen/zero.py``),
so that a rank holds its shards plus one group's pieces; on a pipeline only the rank's chunks'.

A parameter that is on the meta device and in none of the weights given is an error
(``WeightsError``), as is a checkpoint tensor of another shape; buffers a checkpoint does not keep
(non-persistent ones: rotary tables) come from the initializers.

**Initialization without weights**: ``codegen/initialize.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.codegen.initialize import Initializer, unset
from autopar.codegen.lower import mangle
from autopar.errors import AutoparError
from autopar.lowerings.experts import PackedSplit
from autopar.passes.trace import Role
from autopar.placement import Spec, is_shard, local_shape


class WeightsError(AutoparError, ValueError):
    """The weights given cannot fill the parallel module's state (a tensor missing or of another
    shape, a path that is not a checkpoint), or a meta-device tensor has no initializer."""


@dataclass(frozen=True)
class Rank0Weights:
    """A state dict held by rank 0 alone (``state_dict``; None on every other rank): each tensor is
    broadcast from rank 0 in turn and every rank keeps its piece (module docstring)."""

    state_dict: dict | None = None


def piece_slices(shape: Sequence[int], spec: Spec, mesh: DeviceMesh) -> tuple[slice, ...]:
    """The slice of a whole tensor of ``shape`` that this rank keeps under ``spec`` on ``mesh``:
    each ``Shard(d)`` axis, in axis order, cuts what is left of dim ``d`` into equal pieces (plans
    split evenly) and keeps the rank's coordinate's."""
    start, size = [0] * len(shape), list(shape)
    for a, p in enumerate(spec):
        n = mesh.size(a)
        if is_shard(p) and n > 1:
            d = p.dim % len(shape)
            if size[d] % n:
                raise WeightsError(f"dim {d} of size {size[d]} does not split evenly over {n} ranks")
            size[d] //= n
            start[d] += mesh.get_local_rank(a) * size[d]
    return tuple(slice(s, s + n) for s, n in zip(start, size))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------------------------
# sources of whole tensors, read a piece at a time
# ------------------------------------------------------------------------------------------------


class _Safetensors:
    """A safetensors checkpoint: a folder (single file or index of shards) or one file."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                with open(index) as f:
                    files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
            elif os.path.exists(single):
                files = None
                path = single
            else:
                raise WeightsError(
                    f"{path} holds no model.safetensors or model.safetensors.index.json: pass the folder "
                    "save_pretrained(..., safe_serialization=True) wrote, or a .safetensors file"
                )
        elif path.endswith(".safetensors") and os.path.exists(path):
            files = None
        else:
            raise WeightsError(f"weights={path!r} is neither a checkpoint folder nor a .safetensors file")
        self._handles: dict[str, object] = {}
        if files is None:
            handle = safe_open(path, framework="pt", device="cpu")
            self._file = {k: path for k in handle.keys()}  # noqa: SIM118 - safe_open is no dict
            self._handles[path] = handle
        else:
            self._file = files
        self._open = safe_open

    def names(self) -> set[str]:
        return set(self._file)

    def read(self, name: str, slices: tuple[slice, ...], shape: Sequence[int]) -> torch.Tensor:
        path = self._file[name]
        if path not in self._handles:
            self._handles[path] = self._open(path, framework="pt", device="cpu")
        sl = self._handles[path].get_slice(name)
        saved = tuple(sl.get_shape())
        if saved != tuple(shape):
            raise WeightsError(f"{name}: shape {saved} in the checkpoint, {tuple(shape)} in the model")
        piece = sl[slices] if slices else sl[:]
        # safetensors may return a view into the whole tensor it read: keep the piece alone
        return piece.clone() if piece.untyped_storage().nbytes() > _nbytes(piece) else piece


class _Rank0:
    """Rank 0's state dict, each tensor broadcast whole from it in turn (collective)."""

    def __init__(self, weights: Rank0Weights, device: torch.device):
        self._sd = weights.state_dict if dist.get_rank() == 0 else None
        if dist.get_rank() == 0 and self._sd is None:
            raise WeightsError("Rank0Weights: rank 0 must pass the state dict (the other ranks pass None)")
        meta = [
            {k: (tuple(v.shape), v.dtype) for k, v in self._sd.items() if isinstance(v, torch.Tensor)}
            if self._sd is not None
            else None
        ]
        dist.broadcast_object_list(meta, src=0)
        self._meta = meta[0]
        self._device = device

    def names(self) -> set[str]:
        return set(self._meta)

    def read(self, name: str, slices: tuple[slice, ...], shape: Sequence[int]) -> torch.Tensor:
        saved, dtype = self._meta[name]
        if saved != tuple(shape):
            raise WeightsError(f"{name}: shape {saved} in rank 0's state dict, {tuple(shape)} in the model")
        backend_device = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        if self._sd is not None:
            whole = self._sd[name].detach().to(backend_device).contiguous()
        else:
            whole = torch.empty(saved, dtype=dtype, device=backend_device)
        dist.broadcast(whole, src=0)
        return whole[slices].clone() if slices else whole


def _source(weights, device: torch.device):
    if weights is None:
        return None
    if isinstance(weights, Rank0Weights):
        return _Rank0(weights, device)
    if isinstance(weights, (str, os.PathLike)):
        return _Safetensors(weights)
    raise WeightsError(
        f"weights= takes a checkpoint folder or .safetensors path, or autopar.Rank0Weights(state_dict); got "
        f"{type(weights).__name__}"
    )


# ------------------------------------------------------------------------------------------------


class StateLoader:
    """This rank's pieces of the model's state, a group of tensors at a time (module docstring):
    ``specs``: state name -> placement; ``state``: name -> the traced tensor; ``names``: every
    name a tensor goes by (its tied aliases), the one ``specs`` uses first."""

    def __init__(
        self,
        model: torch.nn.Module,
        state: dict[str, torch.Tensor],
        specs: dict[str, Spec],
        names: dict[str, list[str]],
        mesh: DeviceMesh,
        device: torch.device,
        weights=None,
        stored: dict[str, PackedSplit] | None = None,
    ):
        self.model, self.state, self.specs, self.names = model, state, specs, names
        self.mesh, self.device = mesh, device
        # packed gate-up weights kept permuted (autopar/lowerings/experts.py:PackedSplit): their
        # pieces are cut from the whole tensor in stored order, so it is read whole
        self.stored = stored or {}
        self.source = _source(weights, device)  # collective for Rank0Weights: every rank builds it
        self.held = self.source.names() if self.source is not None else set()
        self._init: Initializer | None = None

    def load(self, targets: Sequence[str], keep: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The pieces of ``targets`` (those in ``keep``, all without it) on the device. Every rank
        calls it with the same ``targets`` in the same order (``Rank0Weights`` broadcasts each)."""
        keep = set(targets) if keep is None else keep
        collective = isinstance(self.source, _Rank0)
        out: dict[str, torch.Tensor] = {}
        missing = []
        for target in targets:
            full, spec = self.state[target], self.specs[target]
            found = next((n for n in self.names.get(target, [target]) if n in self.held), None)
            if found is not None:
                if target in keep or collective:
                    if target in self.stored:
                        piece = self._piece(target, self.source.read(found, (), full.shape))
                    else:
                        piece = self.source.read(found, piece_slices(full.shape, spec, self.mesh), full.shape)
                    if target in keep:
                        out[target] = piece.to(device=self.device, dtype=full.dtype).contiguous()
            elif not full.is_meta:
                if target in keep:
                    out[target] = self._piece(target, full.detach()).to(self.device).clone()
            elif target in keep:
                missing.append(target)
        if missing:
            out.update(self._initialized(missing))
        return out

    def _piece(self, target: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole`` (the model's tensor ``target``), in stored order."""
        if target in self.stored:
            whole = self.stored[target].to_stored(whole)
        return whole[piece_slices(whole.shape, self.specs[target], self.mesh)]

    def _initialized(self, missing: list[str]) -> dict[str, torch.Tensor]:
        params = {n for n, _ in self.model.named_parameters()}
        absent = [m for m in missing if m in params]
        if self.source is not None and absent:
            raise WeightsError(
                f"{len(absent)} parameter(s) are in none of the weights given, e.g. {absent[:3]} (the weights have "
                f"{len(self.held)} tensors, e.g. {sorted(self.held)[:3]}): load a checkpoint of this model"
            )
        if self._init is None:
            self._init = Initializer(self.model, self.device)
        want = {n: t for t in missing for n in self.names.get(t, [t])}
        out: dict[str, torch.Tensor] = {}
        for name, whole in self._init.pieces(set(want)):
            target = want.get(name)
            if target is None or target in out:
                continue
            if unset(whole):
                raise WeightsError(
                    f"{name} is on the meta device and no initializer of its module writes it (Hugging Face "
                    "_init_weights, or reset_parameters()): pass weights= (a checkpoint), build the model on a real "
                    "device, or give its module a reset_parameters()"
                )
            out[target] = self._piece(target, whole.detach()).clone()
        lost = [t for t in missing if t not in out]
        if lost:
            raise WeightsError(
                f"no initializer made {lost[:3]}: pass weights= or build the model on a real device"
            )
        return out


class StandIns:
    """The module's parameters and buffers before they are made: meta ``DTensor`` stand-ins of
    the pieces' shapes (``attrs``: mangled name -> stand-in), which the graph is lowered on, and
    ``load(module)``, which makes real, in place, the stand-ins registered in ``module``."""

    def __init__(
        self,
        model,
        tg,
        specs: dict[str, Spec],
        aliases: dict[str, str],
        mesh,
        mesh_shape,
        device,
        weights,
        stored: dict[str, PackedSplit] | None = None,
    ):
        self._tg, self._specs, self._mesh = tg, specs, mesh
        self._roles = {p.target: p.role for p in tg.placeholders}
        self.attrs: dict[str, torch.Tensor] = {}
        for t, spec in specs.items():
            full = tg.state[t]
            meta = torch.empty(local_shape(full.shape, spec, mesh_shape), dtype=full.dtype, device="meta")
            self.attrs[mangle(t)] = self._state(meta, t)
        self._target = {mangle(t): t for t in specs}
        self._order = {t: i for i, t in enumerate(specs)}
        tied: dict[str, list[str]] = {}  # each tensor's names: the traced one first
        for name, fqn in aliases.items():
            tied.setdefault(fqn, [fqn])
            if name != fqn:
                tied[fqn].append(name)
        self._loader = StateLoader(model, tg.state, specs, tied, mesh, device, weights, stored)

    def _state(self, piece: torch.Tensor, target: str) -> torch.Tensor:
        """``piece`` as the module holds it: a ``DTensor`` of the plan's placement (a
        ``Parameter`` for a parameter, needing a gradient as the model's does)."""
        state = DTensor.from_local(piece, self._mesh, self._specs[target], run_check=False)
        if self._roles[target] is Role.PARAM:
            state = torch.nn.Parameter(state, requires_grad=self._tg.state[target].requires_grad)
        return state

    def load(self, module: torch.nn.Module, keep: set[str] | None = None) -> None:
        """Make real the stand-ins registered in ``module`` (of them, those ``keep`` names; all
        without it), replacing each where it is registered. Every rank calls it alike."""
        owned = [
            (owner, leaf)
            for owner in module.modules()
            for leaf, t in [*owner._parameters.items(), *owner._buffers.items()]
            if t is not None and self.attrs.get(leaf) is t
        ]
        targets = sorted({self._target[leaf] for _, leaf in owned}, key=self._order.__getitem__)
        pieces = self._loader.load(targets, keep)
        for owner, leaf in owned:
            t = self._target[leaf]
            if t in pieces:
                value = self._state(pieces[t], t)
                if isinstance(value, torch.nn.Parameter):
                    owner.register_parameter(leaf, value)
                else:
                    owner.register_buffer(leaf, value)
