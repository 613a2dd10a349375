"""A plain loop over torchdata's StatefulDataLoader that checkpoints the loader mid-epoch:
`--save-at K FILE` saves model, optimizer and loader before step K; `--resume FILE` loads them
and trains the steps left (`--no-loader-restore`: the loader's state is not loaded, so the
epoch starts again).  Under `samebits run`, the census names the loader by the line that made
it and records its position (tests/test_transparency.py)."""

import argparse

import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--save-at", nargs=2, metavar=("STEP", "FILE"))
parser.add_argument("--resume")
parser.add_argument("--no-loader-restore", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = StatefulDataLoader(data, batch_size=2, shuffle=True)  # the loader's line
step = 0
if args.resume:
    checkpoint = torch.load(args.resume, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"])
    if not args.no_loader_restore:
        loader.load_state_dict(checkpoint["loader"])
    step = checkpoint["step"]
for x, y in loader:  # the iterator's line
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if args.save_at and step == int(args.save_at[0]):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "loader": loader.state_dict(), "step": step}, args.save_at[1])
print("final", [v.view(torch.int32).tolist() for v in model.state_dict().values()])
