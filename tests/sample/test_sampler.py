"""The batched sampler on crafted logits, against independent reference computations."""

import math

import pytest
import torch

from pagellm.sample.penalties import PenaltyState
from pagellm.sample.sampler import Sampler, SamplingBatch
from pagellm.sampling_params import SamplingParams


def batch_of(params, generators=None, banned=None):
    n = len(params)
    return SamplingBatch(
        params=list(params),
        generators=generators or [None] * n,
        banned_token_ids=banned or [[] for _ in range(n)],
    )


def draws(logits_row, params, count=4000, seed=0):
    """Sample `count` tokens for one row, all in one batch (rows are independent)."""
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).repeat(count, 1)
    return Sampler()(logits, batch_of([params] * count)).token_ids


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_top_k_never_samples_outside_the_k_best():
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    assert set(tokens) == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = LOGITS.softmax(0)
    # p = mass of the best three tokens minus a little: exactly those three remain.
    p = float(probs[:3].sum()) - 1e-4
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, top_p=p))
    assert set(tokens) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = LOGITS.softmax(0)
    min_p = float(probs[3] / probs[0]) - 1e-4  # token 3 just survives, token 4 does not
    tokens = draws(LOGITS, SamplingParams(temperature=1.0, min_p=min_p))
    assert set(tokens) == {0, 1, 2, 3}


def test_extreme_values_the_schema_accepts_are_exact():
    """A temperature float32 cannot divide by is greedy; a top_p it rounds to 0 keeps the
    best token alone (both gave NaN probabilities, so garbage tokens)."""
    shuffled = LOGITS[[3, 0, 5, 1, 7, 2, 6, 4]]  # the best token is 1
    for params in (SamplingParams(temperature=1e-40), SamplingParams(top_p=5e-324), SamplingParams(temperature=1e-6, top_p=1e-300)):
        assert set(draws(shuffled, params, count=200)) == {1}, params
    assert SamplingParams(temperature=1e-40).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    from pagellm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=1e-300)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_the_distribution(temperature):
    count = 20000
    tokens = draws(LOGITS, SamplingParams(temperature=temperature), count=count, seed=1)
    expected = (LOGITS / temperature).softmax(0)
    for token, p in enumerate(expected.tolist()):
        observed = tokens.count(token) / count
        sigma = math.sqrt(p * (1 - p) / count)
        assert abs(observed - p) <= 5 * sigma + 1e-4, (token, observed, p)


def test_greedy_takes_the_argmax_and_banned_tokens_are_skipped():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = Sampler()(logits.clone(), batch_of([SamplingParams(temperature=0)] * 2, banned=[[0], []]))
    assert out.token_ids == [1, 7]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    params = SamplingParams(temperature=1.0, seed=3)

    def sample(rows_before):
        gen = torch.Generator().manual_seed(3)
        logits = LOGITS.unsqueeze(0).repeat(rows_before + 1, 1)
        out = Sampler()(
            logits,
            batch_of([SamplingParams(temperature=1.0)] * rows_before + [params], [None] * rows_before + [gen]),
        )
        return out.token_ids[-1]

    assert len({sample(k) for k in (0, 1, 5, 17)}) == 1


def test_logprobs_equal_log_softmax_of_the_logits_with_ranks():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=1.0, logprobs=0), SamplingParams(temperature=0)]
    out = Sampler()(logits.clone(), batch_of(params))
    reference = logits.log_softmax(-1)
    for row in (0, 1):
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(float(reference[row, token]), abs=1e-6)
        assert entry.ranks[0] == int((reference[row] > reference[row, token]).sum()) + 1
    top = out.logprobs[0]
    assert top.token_ids[1:] == reference[0].topk(5).indices.tolist()
    assert top.logprobs[1:] == pytest.approx(reference[0].topk(5).values.tolist(), abs=1e-6)
    assert top.ranks[1:] == [1, 2, 3, 4, 5]
    assert len(out.logprobs[1].token_ids) == 1 and out.logprobs[2] is None


def test_penalties_and_logit_bias_match_independent_references():
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(1, vocab) * 3
    prompt = [3, 4, 5, 5]
    outputs = [5, 9, 9, 9, 12]
    params = SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={7: 2.5, 12: -1.0},
    )
    state = PenaltyState(vocab, torch.device("cpu"))
    state.add("r", prompt, outputs[:2])
    state.record(["r", "r", "r"], outputs[2:])  # counts kept incrementally
    rows = state.rows_of(["r"])
    batch = batch_of([params])
    batch.penalty_rows = [0]
    batch.output_counts = state.output_counts[rows]
    batch.prompt_mask = state.prompt_mask[rows]

    ours = logits.clone()
    Sampler()(ours, batch)

    expected = SequenceBiasLogitsProcessor({(7,): 2.5, (12,): -1.0})(torch.tensor([prompt + outputs]), logits.clone())
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + outputs]), expected)
    for token in set(outputs):
        count = outputs.count(token)
        expected[0, token] -= 0.4 * count + 0.7
    torch.testing.assert_close(ours, expected)
