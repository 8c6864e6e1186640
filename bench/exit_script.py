"""The exit bench's script (bench/exits.py): a plain Accelerate script, world size 2, that trains a few steps,
reduces and gathers as training scripts do, writes that it finished, ends training and returns."""

import os
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.reduce(loss.detach(), "mean").item()
accelerator.gather(torch.arange(4)).tolist()
with open(os.path.join(sys.argv[1], f"finished-rank{accelerator.process_index}"), "w") as f:
    f.write("ok")
accelerator.end_training()
