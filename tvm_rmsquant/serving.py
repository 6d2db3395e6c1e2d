"""Which bundle serves each variant, and the one static -> dynamic -> reference choice.

Two facts with one home each. ``serve`` records, per variant name, the bundle whose
kernel runs it (later registrations win) and tells the C++ ops (``tvm_rmsquant.native``)
of exactly the variants whose bundle changed, so that the C++ registry mirrors this one.
``choose`` picks, from a bundle's contents only (no device query), the static-K kernel,
else the dynamic-K one, else none (the torch reference), with the reason for each
candidate. ``select``, the functional API and vLLM's out-variant all ask both, so that a
layer's first call and its hundredth take the same path.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Optional, Tuple

from .loader import Bundle
from .spec import VariantSpec


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    taken: bool
    reason: str


_lock = threading.Lock()
_serving: Dict[str, Bundle] = {}


def serve(bundle: Bundle, cuda: bool) -> Optional[str]:
    """Route ``bundle``'s variants to it; on CUDA also through the C++ ops where this torch
    can load them. Returns why the C++ ops do not run them, or None when they do."""
    with _lock:
        changed = [name for name in bundle.names() if _serving.get(name) is not bundle]
        for name in changed:
            _serving[name] = bundle
    if not cuda:
        return "no CUDA device"
    from . import native  # torch's C++ ops: only where there is CUDA

    return native.activate(bundle, changed)


def bundle_for(name: str) -> Optional[Bundle]:
    """The bundle serving variant ``name``, or None when no served bundle has it."""
    return _serving.get(name)


def choose(spec: VariantSpec, bundle: Bundle) -> Tuple[Optional[VariantSpec], List[Candidate]]:
    """(the variant that runs ``spec``'s rows, why) from ``bundle``: static-K, then dynamic-K;
    None when neither is there or accepts the rows (the torch reference runs them)."""
    why: List[Candidate] = []
    for candidate in dict.fromkeys((spec, spec.with_hidden(None))):
        if candidate not in bundle:
            why.append(Candidate(candidate.name, False, f"not in bundle {bundle.path}"))
            continue
        reason = None if spec.hidden is None else candidate.accepts_hidden(spec.hidden)
        if reason is not None:
            why.append(Candidate(candidate.name, False, reason))
            continue
        return candidate, why
    return None, why
