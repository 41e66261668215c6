""""Did you mean" for a mistyped option, key or value: the closest valid names by ``difflib``."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(given: object, valid: Iterable[object]) -> str:
    """``"did you mean 'k3'? "`` when ``given`` is close to one of ``valid`` (difflib's ratio ≥ 0.6), else ``""``;
    goes before the message's list of choices."""
    names = [str(name) for name in valid]
    close = difflib.get_close_matches(str(given), names, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close and close[0] != str(given) else ""
