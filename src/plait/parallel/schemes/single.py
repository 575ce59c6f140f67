"""One model replica (plait.parallel.single): the base Strategy owns the step."""

from __future__ import annotations

from plait.parallel.scheme import Scheme

SCHEME = Scheme("single", applies=lambda layout, keys: True, strategy="plait.parallel.single:build")
