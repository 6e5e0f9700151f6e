"""Memory that depends on the data: tables over sequence lengths, a token budget, the evaluation batch.

:mod:`.probe` runs the table (:func:`probe_lengths`) through a runner that trains at any
``(batch, seq_len)``: :mod:`.runner` on a device, :mod:`autobatch.estimating.lengths` on fake
tensors; the searches themselves are :mod:`autobatch.probing.guided`. :mod:`.table` is the answer.
"""

from __future__ import annotations

from .probe import probe_lengths
from .table import LengthRow, LengthTable

__all__ = ["LengthRow", "LengthTable", "probe_lengths"]
