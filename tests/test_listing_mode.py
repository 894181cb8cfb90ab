"""`ListingMode`: when listings come with attributes (no mount: the policy alone)."""

from __future__ import annotations

from fanstore_fuse._fuse_ops import ListingMode

NAMES, PLUS, PROBE = ListingMode.NAMES, ListingMode.PLUS, ListingMode.PROBE


def test_listings_come_without_attributes_until_files_are_looked_up() -> None:
    m = ListingMode()
    m.file_lookups += 1  # before any listing (the daemon's own open at start): no evidence
    assert [m.start() for _ in range(5)] == [NAMES] * 5  # find: nothing is stat'ed
    m.file_lookups += 300  # a walk stats the files of the directory it listed
    assert m.start() == PLUS


def test_a_walk_that_stats_keeps_attributes_and_probes_every_eighth_listing() -> None:
    m = ListingMode()
    m.start()
    m.file_lookups += 10
    modes = []
    for _ in range(3 * ListingMode.PROBE_EVERY):
        modes.append(m.start())
        if modes[-1] == PROBE:
            m.file_lookups += 1  # the probe's file, listed plainly, is stat'ed: a LOOKUP
    assert modes.count(PROBE) == 3 and modes.count(NAMES) == 0
    assert modes[ListingMode.PROBE_EVERY - 1] == PROBE


def _at_a_probe() -> ListingMode:
    """A mode that switched to attributes (files stat'ed after a listing) and began a probe."""
    m = ListingMode()
    m.start()
    m.file_lookups += 10
    while m.start() != PROBE:
        pass
    return m


def test_a_probe_whose_file_is_not_stated_ends_the_attributes() -> None:
    m = _at_a_probe()
    assert m.start() == NAMES  # nothing looked up since the probe: find follows the walk
    assert m.start() == NAMES


def test_a_listing_without_files_probes_the_next_one() -> None:
    m = _at_a_probe()
    m.no_probe()  # a directory of directories: no file to hold back
    assert m.start() == PROBE
    m.file_lookups += 1
    assert m.start() == PLUS
