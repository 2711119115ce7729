"""Environment switches of the CPU kernels (KVPILOT_QMATMUL_ACTIVATIONS, KVPILOT_CPU_DECODER_STACK):
one parser, so that every switch reads and refuses values the same way."""

from __future__ import annotations


def switch(name: str, value: str | None, choices: dict[str, bool], default: bool = True) -> bool:
    """Pure: the variable `name` set to `value`: unset or empty -> `default`, one of `choices` -> its
    meaning; anything else raises ValueError naming the variable and the values it takes."""
    if value in (None, ""):
        return default
    if value in choices:
        return choices[value]
    raise ValueError(f"{name}={value!r}: expected {' or '.join(choices)}")
