"""Load-tracker states shared by the load and index tests."""

from __future__ import annotations


def young_after_churn(step) -> int:
    """Objects in the cyclic GC's youngest generation after 20,000 steps of a route-and-expire
    churn at CPython's default thresholds (each step makes one long-lived record and expiry frees
    an old one)."""
    import gc

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(700, 10, 10)
    try:
        for k in range(20_000):
            step(k)
        return len(gc.get_objects(0))
    finally:
        gc.set_threshold(*old)
