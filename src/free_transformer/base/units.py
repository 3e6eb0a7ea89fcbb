"""Units. Losses and what Z holds are reported in bits, torch computes in nats; κ is given in bits in
configs and converted here, once."""

from __future__ import annotations

import math

LN2 = math.log(2.0)  # nats per bit


def bits_to_nats(bits: float) -> float:
    return float(bits) * LN2


def nats_to_bits(nats: float) -> float:
    return float(nats) / LN2
