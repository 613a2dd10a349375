"""torch.func and torch.export of a module, as a program uses them: printed, to compare a
plain run with one under `samebits run` (tests/test_transparency.py).  The module forward
hooks of zero-code recording see functional and fake tensors here, which hold no data.

    python transforms.py [vmap] [grad] [export]     # all three by default, then one training step
"""

import sys

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
x = torch.randn(5, 3)
what = sys.argv[1:] or ["vmap", "grad", "export"]


def bits(tensor):
    return tensor.detach().contiguous().view(torch.int32).flatten().tolist()


if "vmap" in what:
    print("vmap", bits(torch.func.vmap(model)(x)))
if "grad" in what:
    params = dict(model.named_parameters())

    def loss(p, inputs):
        return torch.func.functional_call(model, p, (inputs,)).square().mean()

    grads = torch.func.grad(loss)(params, x)
    print("grad", {name: bits(g) for name, g in sorted(grads.items())})
if "export" in what:
    exported = torch.export.export(model, (x,))
    print("export", bits(exported.module()(x)))
    print("graph", [node.op for node in exported.graph.nodes])

# then a training step as usual: the hooks that stood aside above record it
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(x).square().mean().backward()
optimizer.step()
print("trained", bits(model[0].weight))
