"""N-gram prompt lookup proposes what followed the latest earlier match of the last n tokens."""

from pagellm.spec_decode.ngram_proposer import propose_ngram


def test_the_longest_latest_match_is_proposed():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # Last 3 tokens [1, 2, 3]: latest earlier match at 6, followed by 7, 8, 1.
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 1]
    assert propose_ngram(tokens, 5, 1, 3) == [7, 8, 1, 2, 3]  # runs into the suffix itself
    assert propose_ngram([5, 6, 7, 5, 6], 2, 2, 2) == [7, 5]


def test_shorter_ngrams_are_tried_when_long_ones_do_not_match():
    tokens = [8, 3, 4, 1, 2, 6, 3]
    assert propose_ngram(tokens, 2, 2, 4) == []  # [6, 3] never appeared before
    assert propose_ngram(tokens, 2, 1, 4) == [4, 1]  # [3] did, at 1


def test_nothing_to_propose():
    assert propose_ngram([], 3, 1, 3) == []
    assert propose_ngram([4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    assert propose_ngram([1, 2, 1], 3, 1, 3) == [2, 1]
