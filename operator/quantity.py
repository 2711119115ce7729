"""Kubernetes memory quantities ("32Gi", "500M", "1.5Gi", "2e9" is not accepted): parse and format."""

from __future__ import annotations

import math
import re
from decimal import Decimal

_SUFFIX: dict[str, Decimal | int] = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([0-9]+(?:[.][0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
MIB = 2**20


def parse_bytes(quantity: str) -> int:
    """Bytes in a Kubernetes quantity (rounded up), e.g. '32Gi' -> 34359738368."""
    match = _QUANTITY.match(quantity.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    number, suffix = match.groups()
    return math.ceil(Decimal(number) * Decimal(_SUFFIX[suffix or ""]))


def format_mebibytes(n_bytes: int) -> str:
    """A quantity in whole MiB, rounded up, in GiB when exact: 1.5 GiB -> '1536Mi', 24 GiB -> '24Gi'."""
    mib = math.ceil(n_bytes / MIB)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
