"""lowcomm: data-parallel training across slow links.

Communication-hiding (ACCO, CO2, eager DiLoCo, CoCoDC) and low-communication (DiLoCo,
DES-LOC, Local SGD) methods on ``torch.distributed``, with a network model that says what each
collective would cost on a declared link and a clock that says whether a time is real or
modeled.
"""

from __future__ import annotations

__version__ = "0.1.0"
