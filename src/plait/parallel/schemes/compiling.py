"""torch.compile per block (plait.parallel.compiling, `train.compile`)."""

from __future__ import annotations

from plait.parallel.keys import CompileKeys
from plait.parallel.scheme import Scheme

SCHEME = Scheme("compile", applies=lambda layout, keys: keys.compile, keys=CompileKeys,
                transform="plait.parallel.compiling:transform")
