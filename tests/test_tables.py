import sys

from smetric_lmc.tables import MAX_COPY, compacted, oversized


def _shrunk(peak: int, left: int) -> dict[int, int]:
    d = {k: k for k in range(peak)}
    for k in range(peak - left):
        del d[k]
    return d


def test_a_map_that_shrank_is_copied_once_it_is_small_enough_to_copy_quickly():
    d = _shrunk(200_000, 20_000)  # its table is ~10x what 20 k entries need
    assert sys.getsizeof(d) > 128 * len(d) * 2
    assert not oversized(d) and compacted(d) is d  # a 20 k-entry copy would stall the loop
    small = _shrunk(200_000, MAX_COPY)
    c = compacted(small)
    assert c is not small and c == small and list(c) == list(small)
    assert sys.getsizeof(c) < sys.getsizeof(small) / 4


def test_a_map_kept_far_below_its_peak_is_copied_anyway():
    d = _shrunk(2_000_000, 20_000)  # a peak's table of ~80 MB for 20 k entries
    assert oversized(d)


def test_a_map_between_two_growth_steps_is_left_alone():
    d = {k: k for k in range(5_000)}
    assert not oversized(d) and compacted(d) is d
