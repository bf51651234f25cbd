"""The generated code names no device: a plan traced on the CPU (or the meta device) runs on CUDA.

A device the tracer saw (``arange(..., device=cpu)``, ``to(device=cpu)``, the device type of a
``torch.autocast`` region, the metadata asserts inside ``torch.no_grad()`` regions, which the
tracer keeps as higher-order-op submodules) would be baked into the rank's code and fail there
("Tensor device mismatch! Expected: cpu, Got: cuda:0"). Every such argument is read at run time
from the module's mesh (``collectives.run_device``). Checked on every example model and on a model
with ``no_grad`` and ``autocast`` regions (Hugging Face's rotary embeddings have had both), whose
parallel step matches the single-device one.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx
from harness import free_link_cpu

import autopar
from autopar import examples
from autopar.launch import run_on_ranks

# what a device looks like in generated code: a torch.device repr, or a device-type string
DEVICE = re.compile(r"device\(type=|['\"](cpu|cuda|meta)(:\d+)?['\"]")
EXAMPLES = ("gpt2_tiny", "llama_tiny", "palm_tiny", "bert_tiny", "t5_tiny", "vit_tiny", "mlp")


class Regions(torch.nn.Module):
    """Rotary-style tables computed under ``torch.no_grad()`` and ``torch.autocast(enabled=False)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv", torch.linspace(0.1, 1.0, 8))
        self.inp = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        with torch.no_grad():
            f = pos[:, None].float() * self.inv.to(device=x.device)
            emb = torch.cat((f, f), -1)
        with torch.autocast(device_type=x.device.type, enabled=False):
            c = emb.cos().to(x.dtype)
        return self.out(torch.relu(self.inp(x)) * c).pow(2).mean()


def build(name: str):
    torch.manual_seed(0)
    if name == "regions":
        return Regions(), (torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1)),)
    return getattr(examples, name)()


def loss_of(out) -> float:
    """The loss a model returned: a scalar, the first of a tuple (``mlp``), or ``.loss``."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    return (out if isinstance(out, torch.Tensor) else out.loss).item()


def call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(**inputs)


def code_of(module: torch.nn.Module) -> str:
    """The code of every graph module in ``module``: the root, blocks, higher-order-op regions."""
    return "\n".join(m.code for m in module.modules() if isinstance(m, fx.GraphModule))


def _rank(rank, world, names):
    out = {}
    for name in names:
        model, inputs = build(name)
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs)
        out[name] = (code_of(pmodel), loss_of(call(pmodel, inputs)))
    return out


def test_regions_trace_as_higher_order_ops_that_name_the_device():
    """The premise: without the rewrite, the traced regions name the trace-time device."""
    from autopar.passes.trace import trace

    model, inputs = build("regions")
    tg = trace(model, inputs)
    subs = [m for n, m in tg.graph_module.named_modules() if n and isinstance(m, fx.GraphModule)]
    assert len(subs) == 2
    assert DEVICE.search(code_of(tg.graph_module))


def test_device_free_rewrites_regions_and_drops_their_asserts():
    from autopar.codegen.lower import device_free
    from autopar.passes.trace import trace

    model, inputs = build("regions")
    tg = trace(model, inputs)
    for sub in tg.graph_module.children():
        if isinstance(sub, fx.GraphModule):
            free = device_free(sub)
            assert not DEVICE.search(free.code), free.code
            assert "_assert_tensor_metadata" not in free.code


@pytest.mark.slow
def test_generated_code_names_no_device():
    names = ("regions", *EXAMPLES)
    refs = {}
    for name in names:
        model, inputs = build(name)
        refs[name] = loss_of(call(model, inputs))
    for rank_out in run_on_ranks(_rank, 2, names):
        for name in names:
            code, loss = rank_out[name]
            found = DEVICE.search(code)
            assert found is None, f"{name}: generated code names a device: {found.group(0)!r}"
            assert loss == pytest.approx(refs[name], rel=1e-5, abs=1e-6), name
