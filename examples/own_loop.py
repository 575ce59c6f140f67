"""Your own training loop on plait's layouts (docs/models.md):

    plait launch --set parallel.dp=2 examples/own_loop.py OUT     # or parallel.zero=3, --set parallel.tp=2 ...
    python examples/own_loop.py OUT                               # the same loop, one process

Plain SGD on scikit-learn's digits, train.steps steps of train.global_batch_size samples; rank 0 writes
OUT/steps.json (loss and gradient norm of each step) and OUT/weights.pt (the plain model's weights).
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import plait

out = Path(sys.argv[1])
x, y = load_digits(return_X_y=True)
data = torch.utils.data.TensorDataset(torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
p = plait.parallelize(model, loss=F.cross_entropy, optimizer=lambda params: torch.optim.SGD(params, lr=0.2))
steps = [p.step(batch) for batch in p.batches(data)]  # this rank's share of each global batch
log = [{"loss": r.loss, "grad_norm": r.grad_norm} for r in steps]  # read after the loop: the steps never waited
p.save(out)  # DCP, the plain model's names: p.load(out) resumes at any layout
weights = p.state_dict()
if p.is_main:
    (out / "steps.json").write_text(json.dumps(log))
    torch.save(weights, out / "weights.pt")
p.close()
