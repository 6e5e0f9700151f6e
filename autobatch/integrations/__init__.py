"""Drop-in integrations: autobatch where users already train (Lightning, the HF Trainer, accelerate).

Each framework is imported only when its module is: ``autobatch.integrations.lightning``,
``autobatch.integrations.hf`` and ``autobatch.integrations.accelerate``. A missing framework
raises one line naming the extra to install (``pip install 'autobatch[lightning]'``). All of them
probe with the library's own search (:func:`autobatch.probe`, every rank in lockstep under
``torch.distributed``), solve with :func:`autobatch.solve`, and leave the model as it was.
Each can also train under :mod:`autobatch.guard`: a rare long batch that runs out of memory is
split inside its step, with the whole batch's update (``AutoBatch(guard=True)``,
``guard_trainer(trainer)``, ``autobatch.integrations.accelerate.guard``).
"""

from __future__ import annotations

__all__ = []  # the integrations are imported by name, each with its framework
