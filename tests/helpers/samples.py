"""Checks that a stream of pieces used every token once per epoch: nothing lost or repeated."""

from __future__ import annotations


def assert_each_token_once_per_epoch(
    pieces: list[tuple[int, int, int]], lengths: dict[int, int]
) -> int:
    """Check pieces `(doc, start, length)` in stream order against document lengths.

    Within an epoch every non-empty document is covered exactly once, from
    offset 0 to its end, without gaps or overlaps; a document starts again only
    after every document of the epoch is complete. The last epoch may be partial.

    Returns:
        The number of completed epochs.
    """
    expected = {doc for doc, n in lengths.items() if n > 0}
    done: set[int] = set()
    open_docs: dict[int, int] = {}
    epochs = 0
    for doc, start, length in pieces:
        assert length >= 1, f"empty piece of document {doc}"
        if start == 0 and doc in done:
            missing = expected - done
            assert not missing and not open_docs, (
                f"document {doc} repeats before the epoch used documents {sorted(missing)[:10]}"
                f" (and left {sorted(open_docs)[:10]} unfinished)"
            )
            done, epochs = set(), epochs + 1
        position = open_docs.pop(doc, 0)
        assert start == position, f"document {doc}: piece starts at {start}, expected {position}"
        end = start + length
        assert end <= lengths[doc], f"document {doc}: piece ends at {end} > {lengths[doc]}"
        if end == lengths[doc]:
            done.add(doc)
        else:
            open_docs[doc] = end
    return epochs
