"""Models, data and losses with the mistakes users make: each must give one line naming its file and line."""

import sys
import torch
import autobatch


def boom():
    raise ValueError("bad config")


class NoForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(64, 10)


def no_forward():
    return NoForward()


class Returns(torch.nn.Module):
    def __init__(self, what):
        super().__init__()
        self.l = torch.nn.Linear(64, 10)
        self.what = what

    def forward(self, x):
        y = self.l(x)
        return {"str": "text", "none": None, "dict": {"logits": y}}[self.what]


def returns_str():
    return Returns("str")


def returns_none():
    return Returns("none")


def returns_dict():
    return Returns("dict")


def frozen():
    model = torch.nn.Linear(64, 10)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def linear():
    return torch.nn.Linear(64, 10)


def _batch(b):
    return torch.randn(b, 64), torch.randint(0, 10, (b,))


def vector_loss():
    return autobatch.Workload(torch.nn.Linear(64, 10), _batch, loss_fn=lambda m, batch: m(batch[0]).sum(1))


def float_loss():
    return autobatch.Workload(torch.nn.Linear(64, 10), _batch, loss_fn=lambda m, batch: 1.5)


def bad_data():
    def make(b):
        raise KeyError("image_path")
    return autobatch.Workload(torch.nn.Linear(64, 10), make)


def exits():
    sys.exit(3)


def ignores_b():
    return autobatch.Workload(torch.nn.Linear(64, 10), lambda b: (torch.randn(3, 64), torch.randint(0, 10, (3,))))
