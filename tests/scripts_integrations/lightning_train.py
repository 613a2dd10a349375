"""A small Lightning script, as a user writes it, for `samebits verify` with --resume-with.

    python lightning_train.py --workdir W --steps 8 --save-every 4          # A, B: save W/ckpt/step=4.ckpt
    python lightning_train.py --workdir W --steps 8 --resume W0/ckpt/step=4.ckpt   # C
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--resume")
    parser.add_argument("--no-callback", action="store_true")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{args.workdir}/ckpt", filename="{step}",
                                                     every_n_train_steps=args.save_every, save_top_k=-1)]
    if not args.no_callback:
        from samebits.integrations.lightning import SamebitsCallback

        callbacks.append(SamebitsCallback())
    trainer = L.Trainer(max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, accelerator="cpu", devices=1)
    trainer.fit(Net(), DataLoader(data, batch_size=4, shuffle=True), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
