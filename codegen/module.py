"""ParallelModule: the rank-local module ``autoparallelize`` returns.

It holds this rank's parameter shards (``parameters()`` yields only those, so any torch optimizer
works), takes the same arguments as the original model (the full global batch on every rank) and
returns the same output structure with full tensors. ``full_state_dict()`` gathers the full,
unsharded state under the original model's state-dict names.

The module owns its DeviceMesh (``self.mesh``). ``forward`` runs the generated graph inside
``collectives.bound_mesh(self.mesh)``: each collective the graph calls runs on this mesh and keeps
it in its autograd context for backward (``codegen/collectives.py``), so several parallel modules
on different meshes may run forward and backward in any interleaving in one process. Nothing
stays bound after a call. ``full_output`` and ``full_state_dict`` pass ``self.mesh`` to
``collectives.gather_full``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen import collectives as C
from autopar.placement import Spec, is_shard


def local_piece(full: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (Partial is never used for stored state)."""
    x = full
    for a, p in enumerate(spec):
        if is_shard(p) and mesh.size(a) > 1:
            x = x.chunk(mesh.size(a), dim=p.dim)[mesh.get_local_rank(a)]
    return x.contiguous()


class ParallelModule(torch.nn.Module):
    def __init__(
        self,
        local: fx.GraphModule,
        mesh: DeviceMesh,
        in_spec: pytree.TreeSpec,
        kwarg_order: Sequence[str],
        input_shapes: Sequence[tuple[int, ...]],
        out_spec: pytree.TreeSpec,
        state_specs: dict[str, tuple[str, Spec]],
        aliases: dict[str, str],
        extra_state: dict[str, torch.Tensor],
        device: torch.device,
        plan,
        grad_sync=None,
        output_specs: Sequence[Spec | None] = (),
    ):
        super().__init__()
        self.local = local
        self.mesh = mesh
        self.plan = plan
        self._in_spec = in_spec
        self._kwarg_order = list(kwarg_order)
        self._input_shapes = [tuple(s) for s in input_shapes]
        self._out_spec = out_spec
        self._state_specs = state_specs  # canonical FQN -> (attribute name, placement)
        self._aliases = aliases  # every state-dict name -> canonical FQN
        self._extra_state = extra_state  # state the graph never reads: kept as it was
        self._device = device
        self.grad_sync = grad_sync  # codegen/grad_sync.GradSync: the overlapped gradient all-reduces
        # the placement of each output leaf (flattened, as pytree orders them; None: not a tensor):
        # all Replicate unless the plan returns outputs as local pieces (autopar.placement.Outputs)
        self.output_specs = tuple(output_specs)

    @property
    def code(self) -> str:
        """The generated rank-local code."""
        return self.local.code

    def forward(self, *args, **kwargs):
        kwargs = {k: kwargs[k] for k in self._kwarg_order if k in kwargs} | {
            k: v for k, v in kwargs.items() if k not in self._kwarg_order
        }
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise TypeError(
                f"the parallel module was planned for inputs structured as {self._in_spec}, got {spec}; "
                "call it with the same positional/keyword arguments as the example inputs"
            )
        for i, (t, shape) in enumerate(zip(flat, self._input_shapes)):
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"input {i} has shape {tuple(t.shape)} but the plan was made for {shape}: plans are specialized "
                    "to the example inputs' shapes; re-plan for this shape"
                )
        flat = [t.to(self._device) if isinstance(t, torch.Tensor) else t for t in flat]
        with C.bound_mesh(self.mesh):
            outs = self.local(*flat)
        return pytree.tree_unflatten(list(outs), self._out_spec)

    @torch.no_grad()
    def full_output(self, piece: torch.Tensor, index: int) -> torch.Tensor:
        """The whole output from this rank's ``piece`` of output leaf ``index`` (``output_specs``
        order); collective: every rank calls it. For plans made with ``outputs=Outputs.LOCAL``."""
        spec = self.output_specs[index]
        if spec is None:
            raise ValueError(f"output {index} is not a tensor")
        return C.gather_full(piece, spec, self.mesh)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors under the original model's state-dict names; collective on every rank."""
        full = {
            fqn: C.gather_full(getattr(self.local, attr).detach(), spec, self.mesh)
            for fqn, (attr, spec) in self._state_specs.items()
        }
        out = {}
        for name, fqn in self._aliases.items():
            out[name] = full[fqn] if fqn in full else self._extra_state[name]
        return out
